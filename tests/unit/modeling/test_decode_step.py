"""The functional decode step samples what stepping the HF model samples (same tokens,
log-probs to float rounding), also on weights packed for oneDNN, sees weights changed
between calls, and stands aside for models it does not know."""

import copy

import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlhf_async.modeling import decode_step as steps_module
from rlhf_async.modeling import generation
from rlhf_async.modeling.decode_step import PACK_MIN_STEPS, _linear, _packs, decode_step
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms

EOS, PAD, V = 3, 0, 24


def _gpt2(**kw) -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=40, n_embd=32, n_layer=2,
                                      n_head=4, eos_token_id=EOS, pad_token_id=PAD, **kw))


def _llama() -> nn.Module:  # grouped-query attention: 4 heads over 2 key/value heads
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, eos_token_id=EOS,
                                        pad_token_id=PAD, rope_theta=500.0))


def _qwen2() -> nn.Module:  # q/k/v projections with biases, tied embeddings
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=1, eos_token_id=EOS,
                                        pad_token_id=PAD, tie_word_embeddings=True))


MODELS = {"gpt2": _gpt2, "gpt2 gelu_new": lambda: _gpt2(activation_function="gelu_new"),
          "llama": _llama, "qwen2": _qwen2}


def _sample_both(monkeypatch, lm: nn.Module, sp: SamplingParams):
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 7, 8, 9, 4, 2], [0, 1, 4, 4, 5, 2]]).repeat(4, 1)
    mask = (ids != PAD).long()  # left padding: rows whose positions start later
    u = sampling_uniforms(0, 0, list(range(len(ids))), sp.max_new_tokens)
    steps: list[int] = []

    def counted(model, most=0):
        step = decode_step(model, most)
        assert step is not None
        return lambda tok, *a: (steps.append(len(tok)), step(tok, *a))[1]

    monkeypatch.setattr(generation, "decode_step", counted)
    fast = sample(lm, ids, mask, sp, u)
    monkeypatch.setattr(generation, "decode_step", lambda model, most=0: None)
    slow = sample(lm, ids, mask, sp, u)
    return fast, slow, steps


@pytest.mark.parametrize("name", MODELS)
def test_the_decode_step_samples_what_the_model_samples(monkeypatch, name):
    torch.manual_seed(0)
    lm = MODELS[name]().eval()
    sp = SamplingParams(max_new_tokens=12, eos_id=EOS, pad_id=PAD, temperature=0.8)
    fast, slow, steps = _sample_both(monkeypatch, lm, sp)
    lengths = fast.response_mask.sum(1)
    assert lengths.min() < 12 and lengths.max() == 12  # rows end early and leave the batch
    assert steps == [int((lengths > t).sum()) for t in range(1, 12)]  # every decode step
    assert torch.equal(fast.response_ids, slow.response_ids)
    assert torch.equal(fast.response_mask, slow.response_mask)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def test_the_next_call_sees_weight_updates_in_place():
    torch.manual_seed(0)
    lm = _gpt2().eval()
    sp = SamplingParams(max_new_tokens=6, eos_id=EOS, pad_id=PAD, min_new_tokens=6)
    ids, mask = torch.tensor([[1, 5, 6, 2]]), torch.ones(1, 4, dtype=torch.long)
    u = sampling_uniforms(0, 0, [0], 6)
    before = sample(lm, ids, mask, sp, u).logprobs
    with torch.no_grad():  # a weight update lands in place, as a generator's swap does
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = sample(lm, ids, mask, sp, u)
    assert not torch.allclose(before, after.logprobs)
    fresh = sample(copy.deepcopy(lm), ids, mask, sp, u)  # loaded with the new weights
    assert torch.equal(after.response_ids, fresh.response_ids)
    assert torch.equal(after.logprobs, fresh.logprobs)


def test_packed_weights_compute_what_the_plain_matmul_does():
    torch.manual_seed(0)
    w, b, x = torch.randn(512, 128), torch.randn(512), torch.randn(5, 128)
    assert _packs(w) and not _packs(w[:64])  # fp32: from PACK_MIN_FP32 elements
    torch.testing.assert_close(_linear(w, b, pack=True)(x), x @ w.T + b, atol=1e-4, rtol=1e-5)
    conv1d = w.T.contiguous()  # GPT-2 stores [in, out]
    torch.testing.assert_close(_linear(conv1d, b, pack=True, conv1d=True)(x), x @ w.T + b,
                               atol=1e-4, rtol=1e-5)
    if _packs(w.bfloat16()):  # a CPU with bf16 in oneDNN
        got = _linear(w.bfloat16(), None, pack=True)(x.bfloat16())
        torch.testing.assert_close(got.float(), (x.bfloat16() @ w.bfloat16().T).float())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_long_generation_samples_the_same_on_packed_weights(monkeypatch, name):
    """From PACK_MIN_STEPS decode steps the step packs weights of PACK_MIN_FP32 elements
    (these models' 128 x 512 MLP weights): the same tokens as the HF model's steps."""
    torch.manual_seed(0)
    lm = (GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=128, n_layer=2,
                                     n_head=4, eos_token_id=EOS, pad_token_id=PAD))
          if name == "gpt2" else
          LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=512,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, eos_token_id=EOS,
                                       pad_token_id=PAD))).eval()
    packed = []
    real = steps_module._packs
    monkeypatch.setattr(steps_module, "_packs", lambda w: packed.append(real(w)) or real(w))
    sp = SamplingParams(max_new_tokens=PACK_MIN_STEPS + 2, eos_id=EOS, pad_id=PAD,
                        min_new_tokens=PACK_MIN_STEPS + 2)
    fast, slow, _ = _sample_both(monkeypatch, lm, sp)
    assert any(packed)
    assert torch.equal(fast.response_ids, slow.response_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-4, rtol=0)


def test_models_it_does_not_know_step_through_their_own_forward():
    assert decode_step(_gpt2()) is not None and decode_step(_llama()) is not None
    assert decode_step(_gpt2(scale_attn_by_inverse_layer_idx=True)) is None
    assert decode_step(_gpt2(activation_function="relu")) is None

    class Wrapped(nn.Module):  # e.g. an engine that owns the HF model
        def __init__(self):
            super().__init__()
            self.module = _gpt2()

    assert decode_step(Wrapped()) is None
    lm = _gpt2()
    lm.transformer.h[0].mlp.c_fc = Adapter(lm.transformer.h[0].mlp.c_fc)  # injected in place
    assert decode_step(lm) is None
    zero3 = _gpt2()
    next(zero3.parameters()).ds_id = 0  # type: ignore[attr-defined]  # as DeepSpeed marks them
    assert decode_step(zero3) is None


class Adapter(nn.Module):
    """A layer injected in place of a model's own (LoRA's way): the step would skip it."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        return self.base(x) + 1.0
