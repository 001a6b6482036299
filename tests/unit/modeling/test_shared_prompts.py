"""A prompt that repeats in a batch runs once: the same logits, gradients and samples as
running every row in full, and only where it saves enough arithmetic."""

import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhf_async.modeling import shared_prompts
from rlhf_async.modeling.generation import SamplingParams, sample, sampling_uniforms
from rlhf_async.modeling.models import disable_dropout, response_logits
from rlhf_async.modeling.shared_prompts import macs_per_token, prompt_groups

EOS, PAD, V = 3, 0, 24


def gpt2():
    torch.manual_seed(0)
    return disable_dropout(GPT2LMHeadModel(GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2)))


def llama():  # grouped-query attention, rotary positions
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def batch(group=3):
    """Three prompts (two left-padded), each `group` times; right-padded responses."""
    prompts = torch.tensor([[PAD, PAD, 5, 6, 7], [4, 8, 9, 10, 11], [PAD, 12, 13, 14, 15]])
    ids = prompts.repeat_interleave(group, 0)
    mask = (ids != PAD).long()
    g = torch.Generator().manual_seed(1)
    resp = torch.randint(4, V, (len(ids), 6), generator=g)
    rmask = torch.ones_like(resp)
    rmask[1::2, 4:] = 0  # some responses ended early
    resp[rmask == 0] = PAD
    return ids, mask, resp, rmask


@pytest.fixture
def always_share(monkeypatch):
    monkeypatch.setattr(shared_prompts, "MIN_SAVED_MACS", {"cpu": 0.0})


def test_groups_are_the_distinct_prompts_with_each_rows_own(always_share):
    ids, mask, _, _ = batch()
    groups = prompt_groups(gpt2(), ids, mask)
    assert groups is not None
    assert torch.equal(ids[groups.first][groups.inverse], ids)
    assert len(groups.first) == 3 and sorted(groups.first.tolist()) == [0, 3, 6]


def test_rows_run_in_full_when_sharing_would_not_pay():
    ids, mask, _, _ = batch()
    model = gpt2()
    assert macs_per_token(model) == 12 * 2 * 32 * 32
    assert prompt_groups(model, ids, mask) is None  # a tiny model: below the CPU bar
    # a 2048-wide, 24-layer model sharing 6 of 9 five-token prompts clears it
    big = GPT2Config(n_embd=2048, n_layer=24, n_head=16)
    assert macs_per_token(torch.nn.Linear(2, 2)) == 0.0  # no config
    model.config = big
    assert prompt_groups(model, ids, mask) is not None
    assert prompt_groups(model, ids[::3], mask[::3]) is None  # every prompt distinct


@pytest.mark.parametrize("make", [gpt2, llama])
def test_shared_prompt_logits_and_gradients_equal_the_full_forwards(make, monkeypatch):
    ids, mask, resp, rmask = batch()
    model = make().train()
    results = []
    for bar in (float("inf"), 0.0):  # every row in full, then each prompt once
        monkeypatch.setattr(shared_prompts, "MIN_SAVED_MACS", {"cpu": bar})
        model.zero_grad()
        logits = response_logits(model, ids, mask, resp, rmask)  # [B, R, V]
        lp = torch.log_softmax(logits, -1).gather(2, resp[..., None]).squeeze(2)
        (lp * rmask).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in
                                          model.named_parameters()}))
    (full, full_grads), (shared, shared_grads) = results
    assert shared.shape == full.shape == (9, 6, V)
    assert torch.allclose(shared, full, atol=1e-5)
    for name, grad in full_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_a_one_token_response_needs_only_the_prompt_pass(always_share):
    ids, mask, resp, rmask = batch()
    model = gpt2().eval()
    with torch.no_grad():
        shared = response_logits(model, ids, mask, resp[:, :1], rmask[:, :1])
    full = model(input_ids=ids, attention_mask=mask,
                 position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[:, -1:]
    assert torch.allclose(shared, full, atol=1e-5)


@pytest.mark.parametrize("make", [gpt2, llama])
def test_sampling_prefills_each_prompt_once_and_draws_the_same_tokens(make, monkeypatch):
    ids, mask, _, _ = batch()
    model = make().eval()
    sp = SamplingParams(max_new_tokens=8, eos_id=EOS, pad_id=PAD)
    u = sampling_uniforms(0, 0, list(range(len(ids))), 8)
    prefill_rows = []
    forward = model.forward

    @functools.wraps(forward)  # the same signature: the cache keyword is read from it
    def counted(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefill_rows.append(len(kwargs["input_ids"]))
        return forward(*args, **kwargs)

    model.forward = counted
    monkeypatch.setattr(shared_prompts, "MIN_SAVED_MACS", {"cpu": float("inf")})
    full = sample(model, ids, mask, sp, u)
    monkeypatch.setattr(shared_prompts, "MIN_SAVED_MACS", {"cpu": 0.0})
    shared = sample(model, ids, mask, sp, u)
    assert prefill_rows == [9, 3]
    assert torch.equal(shared.response_ids, full.response_ids)
    assert torch.equal(shared.response_mask, full.response_mask)
    assert torch.allclose(shared.logprobs, full.logprobs, atol=1e-5)
