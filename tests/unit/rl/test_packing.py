"""Token-budget micro-batches and packed rows give the padded row micro-batches' loss and
gradients (fp32, float tolerance), for GRPO (actor only) and PPO (actor and critic).

The batch is hand-built with very different lengths: left-padded prompts of 1-5 tokens and
right-padded responses of 1-11 tokens, so a budget of 14 tokens cuts it into several
micro-batches, one row (5 + 11 = 16 tokens) alone over the budget.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_async.config import AlgoConfig, ConfigError, ModelConfig, TrainConfig, load_config
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    response_logits,
    response_values,
    scalar_model_from_actor,
    tiny_config,
)
from rlhf_async.modeling.packing import packed_view, packs
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.microbatches import MicroBatcher, plan

V, PAD = 16, 0
PROMPTS = [2, 5, 1, 3, 4, 1]  # real prompt tokens per row
RESPONSES = [1, 11, 3, 6, 2, 9]  # real response tokens per row


def tiny(arch: str = "gpt2"):
    cfg = tiny_config(ModelConfig(arch=arch, hidden=32, layers=2, heads=2), V, PAD, 1, 2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    B, P, R = len(PROMPTS), max(PROMPTS), max(RESPONSES)
    prompt_ids = torch.full((B, P), PAD)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_ids = torch.full((B, R), PAD)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        prompt_ids[i, P - p:] = torch.randint(3, V, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :r] = torch.randint(3, V, (r,), generator=g)
        response_mask[i, :r] = 1  # POLICY tokens
    m = response_mask.float()
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask,
                        behaviour_logprobs=-2.0 * m, sample_ids=torch.arange(B),
                        group_ids=torch.arange(B) // 2, step=0,
                        rewards=torch.tensor([1.0, 0.0, 0.5, -1.0, 2.0, 0.0]),
                        ref_logprobs=-2.5 * m)


def test_plan_sorts_longest_first_and_keeps_budget():
    # lengths 3, 10, 5, 20 (over 12: alone), 4
    prompts, responses = [1, 4, 2, 5, 1], [2, 6, 3, 15, 3]
    assert plan(prompts, responses, 12, packed=True) == [[3], [1], [2, 4, 0]]
    # padded: rows x (longest prompt + longest response); 5 + 4 -> 2 x (2 + 3) = 10 <= 12
    assert plan(prompts, responses, 12, packed=False) == [[3], [1], [2, 4], [0]]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_view_matches_padded_logits_and_values(arch):
    actor = tiny(arch)
    critic = scalar_model_from_actor(actor, seed=3)
    assert packs(actor) and packs(critic)
    b = batch()
    args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    view = packed_view(b)
    assert view.input_ids.numel() < 2 * (sum(PROMPTS) + sum(RESPONSES))  # little padding
    m = b.loss_mask.bool()
    with torch.no_grad():
        padded = response_logits(actor, *args)  # [B, R, V]
        packed = view.logits(actor)[0]  # [n, V]
        assert len(packed) == int(m.sum())
        assert torch.allclose(packed, padded[view.rows, view.cols], atol=1e-5)
        assert torch.allclose(view.restore(view.values(critic)), response_values(critic, *args)
                              * m, atol=1e-5)


def test_a_model_that_mixes_sequences_does_not_pack():
    class Leaky(torch.nn.Module):  # every position sees the sum over the whole row
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, position_ids=None, **_):
            x = input_ids.float().cumsum(dim=1)[..., None] * self.w
            return type("Out", (), {"logits": x.expand(-1, -1, V)})()

    assert not packs(Leaky())
    assert packs(tiny())
    budget = TrainConfig(max_tokens_per_microbatch=64)
    assert not MicroBatcher.for_models(budget, [tiny(), Leaky()]).packed  # both or neither
    assert MicroBatcher.for_models(budget, [tiny()]).packed
    assert not MicroBatcher.for_models(TrainConfig(), [tiny()]).packed  # no budget: rows


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    """Run one train_step, keeping every trained weight's gradient before the update."""
    seen: dict[str, torch.Tensor] = {}
    for name, backend in learner.backends().items():
        step = backend.step

        def capture(name=name, backend=backend, step=step):
            for k, p in backend.module.named_parameters():
                if p.grad is not None:
                    seen[f"{name}.{k}"] = p.grad.clone()
            return step()

        backend.step = capture
    stats = learner.train_step(batch())
    # flops/train counts the passes run (a token budget adds the old-log-prob forward), not
    # a result of them
    seen.update({f"stat.{k}": torch.tensor(v) for k, v in stats.items() if k != "flops/train"})
    return seen


def _learners(algo: str, **algo_kw) -> dict[str, Learner]:
    actor = tiny()
    critic: ScalarHeadModel | None = scalar_model_from_actor(actor, 3) if algo == "ppo" \
        else None
    a = AlgoConfig(name=algo, kl_mode="loss" if algo != "ppo" else "reward", **algo_kw)
    out = {}
    for name, budget in (("rows", 0), ("packed", 14), ("padded", 14)):
        t = TrainConfig(epochs=1, minibatches=1, lr=1e-3, critic_lr=1e-3,
                        max_tokens_per_microbatch=budget)
        out[name] = Learner(copy.deepcopy(actor), copy.deepcopy(critic), a, t, seed=0)
    out["padded"].micro.packed = False  # what a model that cannot pack falls back to
    assert out["packed"].micro.packed
    return out


@pytest.mark.parametrize(("algo", "kw"), [
    ("grpo", {}),
    ("grpo", {"loss_agg": "seq_mean_token_mean"}),
    ("dr_grpo", {}),  # seq_mean_token_sum
    ("ppo", {}),
])
def test_token_budget_and_packing_give_the_row_micro_batch_update(algo, kw):
    torch.set_num_threads(1)
    grads = {name: _grads(learner) for name, learner in _learners(algo, **kw).items()}
    ref = grads["rows"]
    assert any(k.startswith("actor.") for k in ref)
    if algo == "ppo":
        assert any(k.startswith("critic.") for k in ref) and "stat.value_loss" in ref
    for name in ("packed", "padded"):
        assert grads[name].keys() == ref.keys()
        for k, g in ref.items():
            assert torch.allclose(grads[name][k], g, rtol=1e-4, atol=1e-6), (name, k)


@pytest.mark.parametrize(("value", "needle"), [
    ("-1", "train.max_tokens_per_microbatch"),
    ("1.5", "train.max_tokens_per_microbatch"),
    ('"lots"', "train.max_tokens_per_microbatch"),
])
def test_bad_budget_is_one_clear_config_error(value, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"train.max_tokens_per_microbatch={value}"])
    assert needle in str(ei.value)


def test_budget_and_row_grad_accum_together_are_rejected():
    with pytest.raises(ConfigError, match="set one"):
        load_config(None, ["train.max_tokens_per_microbatch=512", "train.grad_accum=2"])
    assert load_config(None, ["train.max_tokens_per_microbatch=512"]) \
        .train.max_tokens_per_microbatch == 512


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_scoring_gives_the_padded_rewards_and_reference_logprobs(arch):
    from rlhf_async.rl.scoring import RewardMix, score

    reference = tiny(arch).eval()
    rm = scalar_model_from_actor(reference, seed=5).eval()
    mix = RewardMix(rule=None)
    b = batch()
    padded = score(rm, reference, b, 0.8, mix)
    packed = score(rm, reference, b, 0.8, mix, packed=True)
    torch.testing.assert_close(packed.rewards, padded.rewards, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed.ref_logprobs, padded.ref_logprobs, rtol=1e-4, atol=1e-5)
    assert (packed.ref_logprobs[~b.loss_mask.bool()] == 0).all()
    assert len(set(padded.rewards.tolist())) == len(b)  # each row read at its own last token
