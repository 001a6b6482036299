import copy

import pytest
import torch

from rlhf_async.config import AlgoConfig, ModelConfig, TaskConfig, TrainConfig
from rlhf_async.modeling.generation import SamplingParams, generate
from rlhf_async.modeling.models import frozen_copy, load_actor, scalar_model_from_actor
from rlhf_async.modeling.rollout import RolloutBatch, RolloutFormatError
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.microbatches import minibatch_rows
from rlhf_async.rl.scoring import RewardMix, score
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask

TASK = SortDigitsTask(TaskConfig())
SP = SamplingParams(max_new_tokens=7, eos_id=EOS, pad_id=PAD)


def models():
    actor = load_actor(ModelConfig(hidden=32, heads=2), VOCAB_SIZE, TASK.special, seed=0)
    rm = scalar_model_from_actor(actor, seed=1)
    return actor, frozen_copy(actor), frozen_copy(rm), scalar_model_from_actor(actor, seed=2)


def scored_batch(actor, ref, rm, step=0, n=4, group=2):
    pb = TASK.prompt_batch(0, "train", step, n, group)
    return score(rm, ref, generate(actor, pb, SP, 0, step, version=5), 1.0,
                 RewardMix(TASK.hidden_scores))


def test_generate_and_score_fill_the_batch():
    actor, ref, rm, _ = models()
    b = scored_batch(actor, ref, rm)
    assert len(b) == 8 and b.version == 5 and b.step == 0
    assert b.response_ids.shape == (8, 7) and b.rewards.shape == (8,)
    # reference == initial actor, so reference log-probs equal the behaviour log-probs
    assert torch.allclose(b.ref_logprobs, b.behaviour_logprobs, atol=1e-4)
    assert (b.ref_logprobs[b.response_mask == 0] == 0).all()
    assert b.hidden_scores.min() >= 0 and b.hidden_scores.max() <= 1


def test_rollout_batch_tensor_roundtrip_and_validation():
    actor, ref, rm, _ = models()
    b = scored_batch(actor, ref, rm)
    t, meta = b.to_tensors(), b.meta()
    back = RolloutBatch.from_tensors(t, meta)
    assert all(torch.equal(v, back.to_tensors()[k]) for k, v in t.items())
    assert back.version == 5
    bad = dict(t)
    del bad["response_mask"]
    bad["extra"] = torch.zeros(1)
    with pytest.raises(RolloutFormatError, match="missing tensor 'response_mask'.*unknown"):
        RolloutBatch.from_tensors(bad, meta)
    bad = dict(t, rewards=torch.zeros(3))
    with pytest.raises(RolloutFormatError, match="rewards: shape"):
        RolloutBatch.from_tensors(bad, meta)
    with pytest.raises(RolloutFormatError, match="meta 'version'"):
        RolloutBatch.from_tensors(t, {"step": 0})
    both = RolloutBatch.concat([b, b.select(torch.tensor([0, 1]))])
    assert len(both) == 10


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_learner_updates_and_reports(algo):
    actor, ref, rm, critic = models()
    before = copy.deepcopy(actor.state_dict())
    learner = Learner(actor, critic, AlgoConfig(name=algo, entropy_coef=0.01, is_cap=2.0,
                                                kl_mode="loss" if algo == "rloo" else "reward"),
                      TrainConfig(epochs=2, minibatches=3), seed=0)
    m = learner.train_step(scored_batch(actor, ref, rm))
    assert learner.version == 1 and m["version"] == 1 and m["samples"] == 8
    for k in ["policy_loss", "entropy", "reward", "kl", "hidden_score", "actor_grad_norm"]:
        assert k in m and m[k] == m[k]  # present and not NaN
    assert ("value_loss" in m) == (algo == "ppo") and ("kl_loss" in m) == (algo == "rloo")
    after = learner.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_learner_rejects_unscored_batch_and_ppo_without_critic():
    actor, _, _, critic = models()
    learner = Learner(actor, critic, AlgoConfig(), TrainConfig(), seed=0)
    b = generate(actor, TASK.prompt_batch(0, "train", 0, 2, 1), SP, 0, 0, 0)
    with pytest.raises(ValueError, match="scored batch"):
        learner.train_step(b)
    with pytest.raises(ValueError, match="critic"):
        Learner(actor, None, AlgoConfig(name="ppo"), TrainConfig(), seed=0)


def test_minibatch_split_ignores_row_order():
    actor, ref, rm, _ = models()
    b = scored_batch(actor, ref, rm)
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    split = [set(b.sample_ids[i].tolist()) for i in minibatch_rows(b, 0, 0, 3)]
    split_perm = [set(b.select(perm).sample_ids[i].tolist())
                  for i in minibatch_rows(b.select(perm), 0, 0, 3)]
    assert split == split_perm and sorted(len(s) for s in split) == [2, 3, 3]


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_single_update_reuses_the_loss_forward_as_old_logprobs(monkeypatch, grad_accum):
    """One optimizer step per batch (GRPO, KL in the loss): skipping the separate old-log-prob
    forward gives the same update and metrics as computing it."""
    runs = []
    for reuse in (True, False):
        actor, ref, rm, _ = models()
        batch = scored_batch(actor, ref, rm, n=4, group=3)
        learner = Learner(actor, None, AlgoConfig(name="grpo", kl_mode="loss",
                                                  kl_estimator="k3", entropy_coef=0.01),
                          TrainConfig(epochs=1, minibatches=1, grad_accum=grad_accum), seed=0)
        assert learner._reuses_logprobs()
        if not reuse:
            monkeypatch.setattr(learner, "_reuses_logprobs", lambda: False)
        calls = []
        orig = learner.actor_backend.model.forward
        monkeypatch.setattr(learner.actor_backend.model, "forward",
                            lambda *a, _c=calls, _o=orig, **k: _c.append(1) or _o(*a, **k))
        runs.append((learner.train_step(batch), learner.state_dict(), len(calls)))
    (m_fast, w_fast, n_fast), (m_full, w_full, n_full) = runs
    assert n_full - n_fast == 1  # one forward pass fewer
    for k in ("policy_loss", "kl", "kl_loss", "entropy", "clip_frac", "reward"):
        assert m_fast[k] == pytest.approx(m_full[k], rel=1e-4, abs=1e-6), k
    for k in w_full:
        assert torch.allclose(w_fast[k], w_full[k], atol=1e-6), k


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_single_update_runs_the_loss_forward_first_for_old_logprobs_and_values(monkeypatch,
                                                                                algo):
    """One optimizer step per batch with advantages that need the old log-probs (PPO's GAE,
    or the KL penalty in the reward): the loss forward's detached outputs as the old ones
    give the same update and metrics as the separate no-grad forwards of actor and critic."""
    runs = []
    for fused in (True, False):
        actor, ref, rm, critic = models()
        batch = scored_batch(actor, ref, rm, n=4, group=3)
        learner = Learner(actor, critic, AlgoConfig(name=algo, kl_mode="reward",
                                                    entropy_coef=0.01),
                          TrainConfig(epochs=1, minibatches=1), seed=0)
        assert learner._reuses_forward() and not learner._reuses_logprobs()
        if not fused:
            monkeypatch.setattr(learner, "_reuses_forward", lambda: False)
        calls = []
        for model in (learner.actor_backend.model, critic):
            orig = model.forward
            monkeypatch.setattr(model, "forward",
                                lambda *a, _c=calls, _o=orig, **k: _c.append(1) or _o(*a, **k))
        runs.append((learner.train_step(batch), learner.state_dict(), len(calls)))
    (m_fast, w_fast, n_fast), (m_full, w_full, n_full) = runs
    assert n_full - n_fast == (2 if algo == "ppo" else 1)  # actor (and critic) once, not twice
    keys = ["policy_loss", "kl", "entropy", "clip_frac", "approx_kl", "advantage_abs"]
    for k in keys + (["value_loss", "critic_grad_norm"] if algo == "ppo" else []):
        assert m_fast[k] == pytest.approx(m_full[k], rel=1e-4, abs=1e-6), k
    for k in w_full:
        assert torch.allclose(w_fast[k], w_full[k], atol=1e-6), k
    for train in (TrainConfig(epochs=2, minibatches=1), TrainConfig(minibatches=2, epochs=1),
                  TrainConfig(epochs=1, minibatches=1, grad_accum=2)):
        assert not Learner(actor, critic, AlgoConfig(name=algo), train, seed=0)._reuses_forward()


def test_several_updates_per_batch_keep_the_separate_old_logprobs():
    actor, _, _, critic = models()
    for algo, train in (("grpo", TrainConfig(epochs=2, minibatches=1)),
                        ("grpo", TrainConfig(epochs=1, minibatches=2)),
                        ("ppo", TrainConfig(epochs=1, minibatches=1))):
        learner = Learner(actor, critic, AlgoConfig(name=algo, kl_mode="loss"), train, seed=0)
        assert not learner._reuses_logprobs()
    learner = Learner(actor, None, AlgoConfig(name="rloo", kl_mode="reward"),
                      TrainConfig(epochs=1, minibatches=1), seed=0)
    assert not learner._reuses_logprobs()  # the KL penalty in the reward needs them first
