import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.activations import ACT2FN

from rlhf_async.config import ConfigError, ModelConfig
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    load_actor,
    response_values,
    scalar_model_from_actor,
    sequence_scores,
    warm_loading,
)

SPECIAL = (0, 1, 3)


def test_builtin_gpt2_and_llama_are_seeded():
    a = load_actor(ModelConfig(), 16, SPECIAL, seed=3)
    b = load_actor(ModelConfig(), 16, SPECIAL, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=False))
    llama = load_actor(ModelConfig(arch="llama"), 16, SPECIAL, seed=0)
    assert llama.config.model_type == "llama"


def test_builtin_gpt2_computes_gpt2s_gelu_with_one_kernel():
    """The built-in GPT-2's activation is torch's tanh GELU: GPT-2's "gelu_new" formula to
    float rounding (not the erf GELU, up to 5e-4 away), and so the same model."""
    actor = load_actor(ModelConfig(hidden=64, layers=2), 16, SPECIAL, seed=0).eval()
    assert actor.config.activation_function == "gelu_pytorch_tanh"
    x = torch.linspace(-6, 6, 1001)
    act = actor.transformer.h[0].mlp.act
    torch.testing.assert_close(act(x), ACT2FN["gelu_new"](x), atol=1e-6, rtol=1e-6)
    assert (act(x) - ACT2FN["gelu"](x)).abs().max() > 1e-4
    twin = AutoModelForCausalLM.from_config(type(actor.config).from_dict(
        actor.config.to_dict() | {"activation_function": "gelu_new"})).eval()
    twin.load_state_dict(actor.state_dict())
    ids = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(actor(input_ids=ids).logits, twin(input_ids=ids).logits,
                                   atol=2e-6, rtol=1e-5)


def test_actor_from_local_directory_and_vocab_check(tmp_path):
    cfg = LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    actor = load_actor(ModelConfig(path=str(tmp_path / "m")), 16, SPECIAL, seed=0)
    assert actor.config.vocab_size == 20
    with pytest.raises(ConfigError, match="smaller than the task"):
        load_actor(ModelConfig(path=str(tmp_path / "m")), 32, SPECIAL, seed=0)
    with pytest.raises(ConfigError, match="cannot load"):
        load_actor(ModelConfig(path=str(tmp_path)), 16, SPECIAL, seed=0)


def test_scalar_head_roundtrip_and_padding_invariance(tmp_path):
    actor = load_actor(ModelConfig(), 16, SPECIAL, seed=0)
    rm = scalar_model_from_actor(actor, seed=0).eval()
    # trunk starts from the actor's weights
    assert torch.equal(rm.trunk.wte.weight, actor.transformer.wte.weight)
    rm.save(tmp_path / "rm")
    back = ScalarHeadModel.load(tmp_path / "rm").eval()
    p = torch.tensor([[0, 1, 5, 6, 2]])
    r, rmask = torch.tensor([[7, 3, 0]]), torch.tensor([[1, 1, 0]])
    s = sequence_scores(rm, p, (p != 0).long(), r, rmask)
    assert torch.allclose(s, sequence_scores(back, p, (p != 0).long(), r, rmask))
    # more left padding and a longer right pad give the same score and values
    p2 = torch.tensor([[0, 0, 0, 1, 5, 6, 2]])
    r2, rmask2 = torch.tensor([[7, 3, 0, 0, 0]]), torch.tensor([[1, 1, 0, 0, 0]])
    assert torch.allclose(s, sequence_scores(rm, p2, (p2 != 0).long(), r2, rmask2), atol=1e-5)
    v1 = response_values(rm, p, (p != 0).long(), r, rmask)[:, :2]
    v2 = response_values(rm, p2, (p2 != 0).long(), r2, rmask2)[:, :2]
    assert torch.allclose(v1, v2, atol=1e-5)


def test_saved_policy_loads_with_transformers(tmp_path):
    from rlhf_async.modeling.models import save_policy
    actor = load_actor(ModelConfig(), 16, SPECIAL, seed=0)
    save_policy(actor, tmp_path / "p", {"algo": "ppo"})
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    assert all(torch.equal(x, y) for x, y in zip(actor.parameters(), back.parameters(), strict=False))
    assert (tmp_path / "p" / "model.safetensors").exists()


def test_dropout_is_off_for_rl_unless_asked_for():
    """GPT-2 configs default to dropout 0.1; un-keyed dropout noise made a text-task PPO
    step differ between one and two ranks (policy loss 0.00959 vs 0.00981)."""
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rlhf_async.config import AlgoConfig, TrainConfig
    from rlhf_async.rl.learner import Learner

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=16, n_layer=1,
                                      n_head=2))
    Learner(gpt2, None, AlgoConfig(name="grpo"), TrainConfig(), seed=0)
    assert {m.p for m in gpt2.modules() if isinstance(m, nn.Dropout)} == {0.0}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         attention_dropout=0.2))
    Learner(llama, None, AlgoConfig(name="grpo"), TrainConfig(), seed=0)
    assert {m.attention_dropout for m in llama.modules() if hasattr(m, "attention_dropout")} \
        == {0.0}
    kept = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=16, n_layer=1,
                                      n_head=2))
    Learner(kept, None, AlgoConfig(name="grpo"), TrainConfig(disable_dropout=False), seed=0)
    assert {m.p for m in kept.modules() if isinstance(m, nn.Dropout)} == {0.1}


def test_warming_the_loader_leaves_threads_and_progress_bars_as_they_were():
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    bar = hf_logging.is_progress_bar_enabled()
    warm_loading()  # what the fork server does before it forks (modeling/warm.py)
    assert torch.get_num_threads() == threads
    assert hf_logging.is_progress_bar_enabled() == bar
