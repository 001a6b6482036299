"""Per-model precision: what is refused, what is held in its dtype, what computes in it."""

import asyncio
import copy

import pytest
import torch

import rlhf_async.modeling.cpu_attention as cpu_attention_module
from rlhf_async.config import (
    AlgoConfig,
    GenerationConfig,
    JobConfig,
    PlacementConfig,
    TrainConfig,
)
from rlhf_async.engines.torch.engine import TorchEngine
from rlhf_async.modeling.cpu_attention import CPU_SDPA
from rlhf_async.modeling.models import response_logits, sequence_scores
from rlhf_async.modeling.precision import Precision, dtype_problems
from rlhf_async.rl.learner import Learner
from rlhf_async.strategies.lockstep import generation_precision
from rlhf_async.strategies.registry import plan_placement, runner_problems
from tests.unit.rl.test_roles import SP, models, scored_batch

BF16 = Precision({"actor": "bf16", "critic": "bf16", "reward": "bf16", "reference": "bf16",
                  "shadow_actor": "bf16"})


def test_what_each_device_and_model_may_run_in():
    assert dtype_problems("cpu", "actor", "bf16") == []
    assert dtype_problems("cuda", "reward", "fp16") == []
    assert "use bf16 or fp32" in dtype_problems("cpu", "reference", "fp16")[0]
    assert "loss scaling" in dtype_problems("cuda", "critic", "fp16")[0]
    assert "is not one of fp32, bf16, fp16" in dtype_problems("cpu", "actor", "fp8")[0]


@pytest.mark.parametrize("devices", [8, 16, 64])
@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_cuda_defaults_bf16_everywhere_are_accepted(strategy, devices):
    """The cuda default (bf16 for every model) validates on a machine without GPUs (a
    batch of 128 prompts: flattening shares whole prompts evenly over 64 devices)."""
    cfg = JobConfig(train=TrainConfig(prompts_per_step=128),
                    placement=PlacementConfig(strategy=strategy, device="cuda",
                                              devices=devices))
    p = plan_placement(cfg.placement, "ppo")
    assert {m.dtype for m in p.models} == {"bf16"}
    assert runner_problems(cfg, p) == []


def test_frozen_models_are_held_in_their_dtype_and_score_in_fp32():
    actor, ref, rm, _ = models()
    b = scored_batch(actor, ref, rm)
    held = BF16.hold("reward", copy.deepcopy(rm))
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}
    args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    s32, s16 = sequence_scores(rm, *args), sequence_scores(held, *args).float()
    assert torch.allclose(s32, s16, atol=0.05 * s32.abs().max().item() + 0.05)
    assert not torch.equal(s32, s16)  # it really ran in bf16


def test_trained_models_compute_under_autocast_over_fp32_master_weights():
    actor, ref, rm, critic = models()
    b = scored_batch(actor, ref, rm)
    args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    with BF16.compute("actor", torch.device("cpu")):
        assert response_logits(actor, *args).dtype == torch.bfloat16
    with Precision().compute("actor", torch.device("cpu")):
        assert response_logits(actor, *args).dtype == torch.float32
    runs = {}
    for name, precision in (("fp32", Precision()), ("bf16", BF16)):
        a, c = copy.deepcopy(actor), copy.deepcopy(critic)
        learner = Learner(a, c, AlgoConfig(), TrainConfig(epochs=1, minibatches=1), seed=0,
                          precision=precision)
        runs[name] = (learner.train_step(b), learner.state_dict())
        assert {p.dtype for p in a.parameters()} == {torch.float32}  # master weights
    (m32, w32), (m16, w16) = runs["fp32"], runs["bf16"]
    assert m16["policy_loss"] == pytest.approx(m32["policy_loss"], abs=0.05)
    assert m16["value_loss"] == pytest.approx(m32["value_loss"], rel=0.1, abs=0.02)
    # the same direction of update, not the same bits
    start = actor.state_dict()
    d32 = torch.cat([(w32[k] - start[k]).flatten() for k in start])
    d16 = torch.cat([(w16[k] - start[k]).flatten() for k in start])
    assert torch.nn.functional.cosine_similarity(d32, d16, dim=0) > 0.9
    assert not torch.equal(d32, d16)


def test_gradient_checkpointing_gives_the_same_update():
    actor, ref, rm, critic = models()
    b = scored_batch(actor, ref, rm)
    out = []
    for ckpt in (False, True):
        learner = Learner(copy.deepcopy(actor), copy.deepcopy(critic), AlgoConfig(),
                          TrainConfig(epochs=1, minibatches=1, gradient_checkpointing=ckpt),
                          seed=0)
        out.append((learner.train_step(b)["policy_loss"], learner.state_dict()))
        flag = getattr(type(learner.actor), "is_activation_checkpointing", None)
        on = learner.actor.is_activation_checkpointing if flag is not None else \
            learner.actor.is_gradient_checkpointing
        assert on == ckpt
    (l0, w0), (l1, w1) = out
    assert l0 == pytest.approx(l1, abs=1e-6)
    assert all(torch.allclose(w0[k], w1[k], atol=1e-6) for k in w0)


def test_a_broadcast_arrives_in_the_shadows_dtype():
    actor, *_ = models()
    shadow = BF16.hold("shadow_actor", copy.deepcopy(actor))
    gen = TorchEngine.serving(shadow, SP, sync_backend="gloo")
    fresh = {k: v + 1.0 for k, v in actor.state_dict().items()}  # fp32, as the trainer sends

    async def commit() -> None:
        await gen.commit((7, fresh))
        await gen.close()
    asyncio.run(commit())
    for k, v in shadow.state_dict().items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, fresh[k].to(torch.bfloat16))


def _attention_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtypes HF's SDPA function is called with from now on."""
    seen: list[torch.dtype] = []
    real = cpu_attention_module.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append(query.dtype)
        return real(module, query, *args, **kwargs)
    monkeypatch.setattr(cpu_attention_module, "sdpa_attention_forward", spy)
    return seen


def test_bf16_attention_computes_in_fp32_on_cpu(monkeypatch):
    """torch's CPU attention is slower in bf16 (4x in its backward): a bf16 model's
    attention, held or under autocast, runs in fp32 there and hands bf16 on (an fp32
    model runs the same CPU attention, in fp32)."""
    actor, ref, rm, critic = models()
    b = scored_batch(actor, ref, rm)
    args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    plain = copy.deepcopy(actor)
    assert Precision().hold("reward", copy.deepcopy(rm)).trunk.config._attn_implementation \
        == CPU_SDPA
    held = BF16.hold("reward", copy.deepcopy(rm))
    assert held.trunk.config._attn_implementation == CPU_SDPA
    learner = Learner(actor, critic, AlgoConfig(), TrainConfig(epochs=1, minibatches=1),
                      seed=0, precision=BF16)
    assert learner.actor.config._attn_implementation == CPU_SDPA
    assert critic.trunk.config._attn_implementation == CPU_SDPA
    seen = _attention_dtypes(monkeypatch)
    s16 = sequence_scores(held, *args)
    assert s16.dtype == torch.bfloat16 and seen and set(seen) == {torch.float32}
    seen.clear()
    with BF16.compute("actor", torch.device("cpu")):
        logits = response_logits(learner.actor, *args)
    assert logits.dtype == torch.bfloat16 and set(seen) == {torch.float32}
    ref_logits = response_logits(plain, *args)
    assert torch.allclose(logits.float(), ref_logits, atol=0.1)
    logits.float().sum().backward()  # the fp32 attention is differentiable
    assert all(p.grad is not None for p in learner.actor.parameters() if p.requires_grad)


def test_lockstep_generation_dtype():
    """generation.dtype: the lock-step loop generates in it, the actor's own by default;
    Separation refuses it (its generators hold the shadow actor in its own dtype)."""
    cfg = JobConfig(generation=GenerationConfig(dtype="fp32"))
    assert generation_precision(cfg, BF16).name("actor") == "fp32"
    assert generation_precision(cfg, BF16).name("reward") == "bf16"
    assert generation_precision(JobConfig(), BF16) is BF16
    cfg = JobConfig(generation=GenerationConfig(dtype="bf16"),
                    placement=PlacementConfig(strategy="separation", devices=2))
    problems = runner_problems(cfg, plan_placement(cfg.placement, "ppo"))
    assert any("placement.dtype = ['shadow_actor=bf16']" in p for p in problems)
