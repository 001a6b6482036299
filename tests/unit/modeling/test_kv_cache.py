import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlhf_async.modeling import generation
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms
from rlhf_async.modeling.kv_cache import BufferLayer, preallocated_cache

EOS, PAD = 3, 0


def test_a_buffer_layer_holds_what_a_growing_layer_holds_without_copying_it():
    grown, buf = DynamicLayer(), BufferLayer(capacity=6)
    k, v = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)
    for lo, hi in ((0, 4),):  # a prompt, then one token at a time
        grown.update(k[:, :, lo:hi], v[:, :, lo:hi])
        buf.update(k[:, :, lo:hi], v[:, :, lo:hi])
    step_k, step_v = torch.randn(3, 2, 1, 5), torch.randn(3, 2, 1, 5)
    keys, values = buf.update(step_k, step_v)
    want_k, want_v = grown.update(step_k, step_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert keys.data_ptr() == buf.key_buffer.data_ptr()  # a view of the buffer, not a copy
    assert buf.get_seq_length() == 5 and buf.get_mask_sizes(1) == (6, 0)
    rows = torch.tensor([2, 0])
    grown.batch_select_indices(rows)
    buf.batch_select_indices(rows)
    assert torch.equal(buf.keys, grown.keys) and torch.equal(buf.values, grown.values)
    buf.update(step_k[:2], step_v[:2])
    with pytest.raises(ValueError, match="KV cache full: 7 positions, allocated for 6"):
        buf.update(step_k[:2], step_v[:2])


def test_only_plain_full_attention_caches_are_preallocated():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=2,
                                      n_head=2))
    cache = preallocated_cache(gpt2, 20)
    assert cache is not None and [type(x) for x in cache.layers] == [BufferLayer] * 2
    mistral = MistralForCausalLM(MistralConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=2,
                                               intermediate_size=32, sliding_window=4))
    assert preallocated_cache(mistral, 20) is None  # sliding-window layers: the model's own


def test_sampling_gives_the_same_responses_with_the_models_own_cache(monkeypatch):
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=2,
                                    n_head=2, eos_token_id=EOS, pad_token_id=PAD)).eval()
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 7, 8, 9, 4, 2], [0, 1, 4, 4, 5, 2]]).repeat(3, 1)
    mask = (ids != PAD).long()
    sp = SamplingParams(max_new_tokens=10, eos_id=EOS, pad_id=PAD, temperature=0.8)
    u = sampling_uniforms(0, 0, list(range(9)), 10)
    batches: list[int] = []
    forward = lm.forward

    @functools.wraps(forward)  # the same signature: the cache keyword is read from it
    def counted(**kwargs):
        batches.append(len(kwargs["input_ids"]))
        return forward(**kwargs)

    monkeypatch.setattr(lm, "forward", counted)
    # every step through the model's forward (the functional decode step skips it; that
    # path has tests of its own in test_decode_step.py)
    monkeypatch.setattr(generation, "decode_step", lambda model, most=0: None)
    fast = sample(lm, ids, mask, sp, u)
    lengths = fast.response_mask.sum(1)
    assert lengths.min() < 10 and lengths.max() == 10  # rows that end early, and one that runs
    # finished rows leave the model's batch: it shrinks as they end, never steps on padding
    assert batches == [9] + [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
    monkeypatch.setattr(generation, "preallocated_cache", lambda model, capacity: None)
    own = sample(lm, ids, mask, sp, u)  # HF's DynamicCache, grown by cat
    monkeypatch.setattr(generation, "preallocated_cache",
                        lambda model, capacity: RowsStay(config=model.config))
    batches.clear()
    stay = sample(lm, ids, mask, sp, u)  # finished rows step on with a masked pad token
    assert batches == [9] * int(lengths.max())
    for other in (own, stay):
        assert torch.equal(fast.response_ids, other.response_ids)
        assert torch.equal(fast.response_mask, other.response_mask)
        torch.testing.assert_close(fast.logprobs, other.logprobs, atol=1e-6, rtol=0)


class RowsStay(DynamicCache):
    """A cache that cannot drop rows (as older transformers' tuples cannot)."""

    @property
    def batch_select_indices(self):
        raise AttributeError("batch_select_indices")
