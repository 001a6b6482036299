"""On-policy distillation's per-token term, and the `distill` preset's step, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_async.config import AlgoConfig, TrainConfig
from rlhf_async.rl.distill import distill_advantages
from rlhf_async.rl.learner import Learner
from tests.unit.rl.test_learner_by_hand import LR, Logits, batch


def test_term_by_hand() -> None:
    teacher = torch.tensor([[-0.1, -2.0, -0.5], [-1.0, -0.2, -3.0]])
    student = torch.tensor([[-0.3, -1.0, -0.5], [-0.5, -0.7, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token: padding
    # (teacher - student) x mask: 0.2, -1.0, 0 | -0.5, 0.5, (masked)
    want = torch.tensor([[0.2, -1.0, 0.0], [-0.5, 0.5, 0.0]])
    assert torch.allclose(distill_advantages(teacher, student, mask), want)
    assert torch.allclose(distill_advantages(teacher, student, mask, coef=0.5), want / 2)


def _learner(name: str, coef: float) -> tuple[Learner, Logits]:
    actor = Logits()
    a = AlgoConfig(name=name, whiten_advantages=False, group_size=2, distill_coef=coef,
                   kl_coef=0.0, kl_target=0.0)
    t = TrainConfig(epochs=1, minibatches=1, lr=LR, grad_clip=0.0)
    return Learner(actor, None, a, t, seed=0), actor


def _with_teacher(group_ids: tuple[int, int] = (0, 1)):
    b = batch(group_ids)  # the student sampled tokens 0 and 1, each at p = 1/2
    return b.replace(teacher_logprobs=torch.tensor([[math.log(0.8)], [math.log(0.2)]]))


def test_distill_preset_step_by_hand() -> None:
    lrn, actor = _learner("distill", 0.0)
    m = lrn.train_step(_with_teacher())  # its rewards (1, 0) are not used
    # advantages = log 0.8 - log 0.5 = +0.4700 (token 0), log 0.2 - log 0.5 = -0.9163
    assert lrn.last_advantages is not None
    assert lrn.last_advantages.flatten().tolist() == pytest.approx(
        [math.log(1.6), math.log(0.4)], abs=1e-6)
    # policy loss = -mean(A) at ratio 1; both advantages push theta_0 up: Adam's first step
    assert m["policy_loss"] == pytest.approx(-(math.log(1.6) + math.log(0.4)) / 2, abs=1e-6)
    assert actor.theta.tolist() == pytest.approx([LR, -LR], abs=1e-6)
    # the reverse KL estimate: mean(log 0.5 - log 0.8, log 0.5 - log 0.2)
    assert m["teacher_reverse_kl"] == pytest.approx(
        (math.log(0.625) + math.log(2.5)) / 2, abs=1e-6)


def test_distill_coef_adds_the_term_to_another_algorithm() -> None:
    lrn, _ = _learner("grpo", 0.5)
    lrn.train_step(_with_teacher((0, 0)))
    # GRPO's +-0.7071 plus 0.5 x (log 1.6, log 0.4)
    assert lrn.last_advantages is not None
    assert lrn.last_advantages.flatten().tolist() == pytest.approx(
        [0.5 ** 0.5 + 0.5 * math.log(1.6), -(0.5 ** 0.5) + 0.5 * math.log(0.4)], abs=1e-5)


def test_distillation_without_teacher_logprobs_is_refused() -> None:
    lrn, _ = _learner("distill", 0.0)
    with pytest.raises(ValueError, match="teacher"):
        lrn.train_step(batch())


def _scored(teacher_apart: bool, monkeypatch: pytest.MonkeyPatch):
    """score() of a 2-row batch by a tiny reference and teacher; `teacher_apart`: the
    teacher reports another device (cpu:1, a CPU stand-in for a GPU of its own), so it
    scores a copy of the batch moved there and its log-probs come back. -> (the scored
    batch, the devices batches were moved to, the models of each forward pass)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_async.modeling.rollout import RolloutBatch
    from rlhf_async.rl import scoring

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    ref, teacher = GPT2LMHeadModel(cfg).eval(), GPT2LMHeadModel(cfg).eval()
    moved, passes = [], []
    own_device, forwards, to = scoring._device, scoring._forwards, RolloutBatch.to
    if teacher_apart:
        monkeypatch.setattr(scoring, "_device", lambda m: torch.device("cpu", 1)
                            if m is teacher else own_device(m))
    monkeypatch.setattr(RolloutBatch, "to", lambda self, d: moved.append(d) or to(self, d))
    monkeypatch.setattr(scoring, "_forwards", lambda lms, *a: passes.append(
        ["teacher" if m is teacher else "reference" for m in lms]) or forwards(lms, *a))
    b = batch().replace(prompt_ids=torch.tensor([[1, 2], [3, 4]]),
                        prompt_mask=torch.ones(2, 2, dtype=torch.long))
    mix = scoring.RewardMix(rule=lambda p, r, m: torch.zeros(len(p)))
    return scoring.score(None, ref, b, 1.0, mix, teacher=teacher), moved, passes


def test_teacher_on_a_device_of_its_own_scores_the_same(monkeypatch) -> None:
    beside, moved, passes = _scored(False, monkeypatch)
    assert moved == [] and passes == [["reference", "teacher"]]
    apart, moved, passes = _scored(True, monkeypatch)
    assert moved == [torch.device("cpu", 1)] and passes == [["reference"], ["teacher"]]
    assert torch.equal(apart.teacher_logprobs, beside.teacher_logprobs)
    assert torch.equal(apart.ref_logprobs, beside.ref_logprobs)
    assert not torch.equal(apart.teacher_logprobs, apart.ref_logprobs)
