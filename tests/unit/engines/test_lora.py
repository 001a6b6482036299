"""LoRA: merged weights as peft merges them, only adapters train, checkpoints of adapters,
the same direction of improvement as full fine-tuning, one error without peft."""

import copy
import importlib.util

import pytest
import torch
from peft.tuners.lora import LoraLayer

from rlhf_async.config import (
    AlgoConfig,
    ConfigError,
    LoraConfig,
    ModelConfig,
    TaskConfig,
    TrainConfig,
    load_config,
)
from rlhf_async.engines import MissingExtraError
from rlhf_async.engines.lora import add_adapters, merged_weights
from rlhf_async.modeling.generation import SamplingParams, generate
from rlhf_async.modeling.models import (
    frozen_copy,
    load_actor,
    response_logits,
    scalar_model_from_actor,
)
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.checkpoint import CheckpointError, learner_state, restore_learner
from rlhf_async.rl.learner import Learner
from rlhf_async.rl.scoring import RewardMix, score
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask

TASK = SortDigitsTask(TaskConfig())
SP = SamplingParams(max_new_tokens=7, eos_id=EOS, pad_id=PAD)
LORA = LoraConfig(rank=4, alpha=8)


def actor(arch="gpt2", seed=0):
    return load_actor(ModelConfig(arch=arch, hidden=32, heads=2), VOCAB_SIZE, TASK.special,
                      seed=seed)


def scored_batch(policy, seed=0):
    ref, rm = frozen_copy(policy), frozen_copy(scalar_model_from_actor(policy, seed=1))
    pb = TASK.prompt_batch(seed, "train", 0, 8, 4)
    return score(rm, ref, generate(policy, pb, SP, seed, 0, 0), 1.0,
                 RewardMix(TASK.hidden_scores))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # Conv1D (W stored [in, out]); Linear
def test_merged_weights_are_base_plus_scaled_BA_as_peft_merges(arch):
    model = actor(arch)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    add_adapters(model, LORA, seed=0)
    with torch.no_grad():  # lora_B starts at 0 (merged == base): give it a value
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    merged = merged_weights(model)
    assert list(merged) == list(plain)  # the base model's names, in its order
    layer = "model.layers.0.self_attn.q_proj" if arch == "llama" else "transformer.h.0.attn.c_attn"
    m = model.get_submodule(layer)
    delta = m.lora_B["default"].weight @ m.lora_A["default"].weight * (8.0 / 4)  # [out, in]
    torch.testing.assert_close(merged[f"{layer}.weight"], plain[f"{layer}.weight"]
                               + (delta.T if arch == "gpt2" else delta))
    peft_merged = copy.deepcopy(model)
    for mod in peft_merged.modules():
        if isinstance(mod, LoraLayer):
            mod.merge()
    for name, t in peft_merged.state_dict().items():
        if ".lora_" not in name:
            torch.testing.assert_close(merged[name.replace(".base_layer.", ".")], t)
    assert sum(torch.equal(merged[k], plain[k]) for k in plain) < len(plain)  # merged moved


def test_only_adapters_and_the_value_head_train_and_publish_plain_names():
    policy = actor()
    critic = scalar_model_from_actor(policy, seed=2)
    batch = scored_batch(policy)
    plain_names = list(policy.state_dict())
    learner = Learner(policy, critic, AlgoConfig(name="ppo"), TrainConfig(lr=1e-2), seed=0,
                      lora=LORA)
    assert learner.adapted == {"actor", "critic"}
    trained = {id(p) for p in learner.actor_backend.params}
    assert trained == {id(p) for n, p in policy.named_parameters() if ".lora_" in n}
    before = {f"actor.{k}": v.clone() for k, v in policy.state_dict().items()}
    before.update({f"critic.{k}": v.clone() for k, v in critic.state_dict().items()})
    learner.train_step(batch)
    after = {f"actor.{k}": v for k, v in policy.state_dict().items()}
    after.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k or k.startswith("critic.head.") for k in changed)
    assert "critic.head.weight" in changed  # the value head trains whole
    assert any(k.startswith("critic.trunk.") for k in changed)  # the critic's adapters
    assert list(learner.state_dict()) == plain_names  # what generators receive


def test_checkpoint_holds_adapters_and_resumes_the_same_continuation():
    runs = []
    for resume in (False, True):
        policy = actor()
        batch = scored_batch(policy)
        learner = Learner(policy, None, AlgoConfig(name="grpo"), TrainConfig(lr=1e-2),
                          seed=0, lora=LORA)
        learner.train_step(batch)
        if resume:
            state = learner_state(learner)
            assert all(".lora_" in k for k in state["actor"])  # no base weights in it
            fresh = actor()
            learner = Learner(fresh, None, AlgoConfig(name="grpo"), TrainConfig(lr=1e-2),
                              seed=0, lora=LORA)
            restore_learner(learner, state)
        learner.train_step(batch)
        runs.append(learner.state_dict())
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=0, atol=0)
    full = Learner(actor(), None, AlgoConfig(name="grpo"), TrainConfig(), seed=0)
    with pytest.raises(CheckpointError, match="written with LoRA .*'rank': 4.*this run has off"):
        restore_learner(full, state)


def _logprob_change(rank: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two GRPO steps on one scored batch: (advantages [B], change of each sample's
    log-prob [B])."""
    policy = actor(seed=1)
    batch = scored_batch(policy)
    m = batch.response_mask.float()

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = response_logits(policy, batch.prompt_ids, batch.prompt_mask,
                                     batch.response_ids, batch.response_mask)
        return (A.gather_logprobs(logits, batch.response_ids, 1.0) * m).sum(1)

    learner = Learner(policy, None, AlgoConfig(name="grpo", kl_coef=0.0, kl_target=0.0),
                      TrainConfig(lr=lr), seed=0, lora=LoraConfig(rank=rank, alpha=2 * rank)
                      if rank else None)
    before = logprobs()
    for _ in range(2):
        learner.train_step(batch)
    return A.grpo_advantages(batch.rewards, batch.group_ids), logprobs() - before


def test_lora_moves_the_policy_the_way_full_fine_tuning_does():
    """The same batch, rewarded by a (random, frozen) reward model: full fine-tuning and
    LoRA both make the samples above their group's mean more likely and those below less
    (seeds 0-3 measured: LoRA +0.6..+1.0 / -0.8..-1.0 nats, full +1.0..+1.7 / -1.7..-1.8;
    the cosine of the two changes 0.88..0.95)."""
    adv, full = _logprob_change(0, 3e-3)
    adv_lora, lora = _logprob_change(8, 1e-2)
    assert torch.equal(adv, adv_lora)  # the same samples
    for change in (full, lora):
        assert change[adv > 0].mean() > 0.2 and change[adv < 0].mean() < -0.2
    assert torch.nn.functional.cosine_similarity(full, lora, dim=0) > 0.6


def test_missing_peft_is_one_error_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'rlhf-async\[lora\]'"):
        add_adapters(actor(), LORA, seed=0)
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["lora.rank=8"])
    assert ei.value.problems == ["lora.rank: LoRA needs peft, which is not installed (pip "
                                 "install 'rlhf-async[lora]'); or lora.rank = 0 for full "
                                 "fine-tuning"]


def test_deepspeed_with_lora_and_an_unknown_target_are_config_errors():
    with pytest.raises(ConfigError, match="LoRA trains with train.backend = 'torch' only"):
        load_config(None, ["lora.rank=8", "train.backend=deepspeed"])
    with pytest.raises(ConfigError, match="lora.target_modules: .*nope"):
        add_adapters(actor(), LoraConfig(rank=4, target_modules=["nope"]), seed=0)
