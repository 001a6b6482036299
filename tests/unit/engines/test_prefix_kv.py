"""Kept KV: a prefill on top of it computes what a full prefill does; the store's LRU, byte
budget, version and token checks."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhf_async.engines.torch.prefix_kv import Prefix, PrefixStore, prefill_after
from rlhf_async.modeling.models import output_cache

PAD = 0


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=2, bos_token_id=1,
                                      eos_token_id=3)).eval()


def _llama() -> LlamaForCausalLM:  # rotary positions, grouped KV heads
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def _kept(lm: torch.nn.Module, tokens: list[int], version: int = 0) -> Prefix:
    """The KV of `tokens` from a plain forward of the model's own cache."""
    with torch.no_grad():
        cache = output_cache(lm(torch.tensor([tokens]), use_cache=True))
    return Prefix(tuple(tokens), tuple(layer.keys[0] for layer in cache.layers),
                  tuple(layer.values[0] for layer in cache.layers), version)


@pytest.mark.parametrize("make", [_gpt2, _llama])
def test_a_prefill_after_kept_kv_matches_the_full_prefill(make):
    lm = make()
    convs = [[5, 6, 7, 8, 9, 10, 11], [4, 2, 9, 9, 1]]  # whole prompts of two rows
    kept = [3, 4]  # the tokens each had kept (different lengths: right-aligned pasts)
    pasts = [_kept(lm, c[:n]) for c, n in zip(convs, kept, strict=True)]
    cache, logits, mask, last = prefill_after(lm, pasts, [c[n:] for c, n in
                                                          zip(convs, kept, strict=True)], PAD)
    assert mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 1]]
    assert last.tolist() == [6, 4]
    for i, conv in enumerate(convs):
        with torch.no_grad():
            full = lm(torch.tensor([conv]), use_cache=True)
        torch.testing.assert_close(logits[i], full.logits[0, -1], atol=1e-5, rtol=1e-5)
        cols = mask[i].nonzero().flatten()
        for ours, theirs in zip(cache.layers, output_cache(full).layers, strict=True):
            torch.testing.assert_close(ours.keys[i][:, cols], theirs.keys[0], atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(ours.values[i][:, cols], theirs.values[0], atol=1e-5,
                                       rtol=1e-5)


def _prefix(tokens: tuple[int, ...], version: int = 0) -> Prefix:
    """A one-layer prefix of 1 head x 2 dims in fp32: 16 bytes a token."""
    kv = torch.arange(2.0 * len(tokens)).reshape(1, len(tokens), 2)
    return Prefix(tokens, (kv,), (kv.clone(),), version)


def test_the_store_hands_over_the_longest_kept_prefix_of_the_salt_and_version():
    store = PrefixStore(1 << 20)
    store.put("a", _prefix((1, 2)))
    store.put("a", _prefix((1, 2, 3, 4)))
    store.put("b", _prefix((1, 2, 3, 4, 5)))
    store.put("a", _prefix((1, 2, 3, 4, 5), version=1))
    assert store.nbytes == 16 * (2 + 4 + 5 + 5)
    assert store.take("a", (1, 2, 9, 9), version=2) is None  # no prefix of this version
    got = store.take("a", (1, 2, 3, 4, 5, 6), version=0)
    assert got is not None and got.tokens == (1, 2, 3, 4)  # not b's, not version 1's
    # it stays: another episode that said the same reuses it too
    assert store.take("a", (1, 2, 3, 4, 7), version=0).tokens == (1, 2, 3, 4)
    assert store.take("a", (1, 2, 7), version=0).tokens == (1, 2)
    assert store.take("a", (7, 2, 3, 4, 5, 6), version=1) is None  # diverged tokens
    # a prompt no longer than the prefix: its last token is left to prefill
    cut = store.take("a", (1, 2, 3, 4, 5), version=1)
    assert cut is not None and cut.tokens == (1, 2, 3, 4) and cut.keys[0].shape == (1, 4, 2)
    assert torch.equal(cut.keys[0], _prefix((1, 2, 3, 4, 5)).keys[0][:, :4])
    assert (store.hits, store.misses, store.reused_tokens) == (4, 2, 4 + 4 + 2 + 4)
    assert len(store) == 4 and store.nbytes == 16 * (2 + 4 + 5 + 5)


def test_the_store_drops_the_least_recently_kept_beyond_its_budget_and_old_versions():
    store = PrefixStore(16 * 10)
    store.put("a", _prefix((1, 2, 3, 4)))
    store.put("b", _prefix((1, 2, 3, 4), version=1))
    assert store.take("a", (1, 2, 3, 4, 5), version=0) is not None  # a used after b
    store.put("c", _prefix((5, 6, 7)))  # 11 tokens > 10: b goes, the least recently used
    assert store.take("b", (1, 2, 3, 4, 5), version=1) is None
    store.put("b", _prefix((1, 2, 3, 4), version=1))  # and now a goes
    assert store.take("a", (1, 2, 3, 4, 5), version=0) is None
    assert store.nbytes == 16 * 7 and len(store) == 2
    store.put("d", _prefix(tuple(range(11))))  # larger than the whole budget: not kept
    assert len(store) == 2
    store.drop_other_versions(1)  # a commit to version 1
    assert len(store) == 1 and store.nbytes == 16 * 4
    assert store.take("b", (1, 2, 3, 4, 9), version=1) is not None
    assert PrefixStore(0).budget == 0 and len(PrefixStore(0)) == 0
