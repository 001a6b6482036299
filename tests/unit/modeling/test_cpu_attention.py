"""CPU attention padded to the kernel's width: the same outputs and gradients as HF's SDPA,
whatever the lengths, masks and head grouping."""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlhf_async.modeling.cpu_attention import (
    CPU_SDPA,
    _bf16_attention,
    _cpu_sdpa,
    _padding,
    _written_out,
    cpu_attention,
)
from rlhf_async.modeling.models import sequence_inputs


class Attn(nn.Module):
    def __init__(self, groups: int = 1, causal: bool = True) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


def qkv(B, H, Hkv, Tq, Tk, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, t, D, generator=g, requires_grad=True)
            for h, t in ((H, Tq), (Hkv, Tk), (Hkv, Tk))]


def same(module, q, k, v, mask, dtype=torch.float32):
    """Our function and HF's on copies of the inputs: outputs and input gradients."""
    results = []
    for fn in (sdpa_attention_forward, _cpu_sdpa):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = fn(module, *leaves, mask)
        out.float().square().sum().backward()
        results.append((out, [t.grad for t in leaves]))
    (want, want_g), (got, got_g) = results
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    for a, b in zip(got_g, want_g, strict=True):
        assert torch.allclose(a.float(), b.float(), atol=tol * 10, rtol=tol * 10)


def test_lengths_pad_to_a_multiple_of_16_only_when_it_is_near():
    lengths = (1, 12, 13, 15, 16, 17, 56, 61, 63)
    assert [_padding(n, 16) for n in lengths] == [0, 0, 3, 1, 0, 0, 0, 3, 1]
    assert [_padding(n, 32) for n in lengths] == [0, 0, 3, 1, 0, 0, 0, 3, 1]
    # from 64 dims (GPT-2 6x384's, SmolLM2's, most real models') the copies cost more
    assert [_padding(n, D) for n in lengths for D in (64, 128)] == [0] * 18


@pytest.mark.parametrize("T", [15, 47])
def test_wide_heads_attend_unpadded_to_the_same_result(T, monkeypatch):
    def no_pad(*args, **kwargs):
        raise AssertionError("padded at 64 dims")
    monkeypatch.setattr(torch.nn.functional, "pad", no_pad)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(2, 1, T, T).clone()
    out, _ = _cpu_sdpa(Attn(), *(t.detach() for t in qkv(2, 2, 2, T, T, D=64)), mask)
    want, _ = sdpa_attention_forward(Attn(), *(t.detach() for t in qkv(2, 2, 2, T, T, D=64)),
                                     mask)
    assert torch.equal(out, want)


@pytest.mark.parametrize("T", [1, 5, 14, 15, 16, 17, 31, 40])
def test_causal_self_attention_without_a_mask(T):
    same(Attn(), *qkv(3, 4, 4, T, T), None)


@pytest.mark.parametrize("Tq,Tk", [(7, 7), (15, 15), (13, 29), (6, 21), (1, 30)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_padding_and_cached_prefixes_under_a_mask(Tq, Tk, kind):
    """Left padding (rows 0 and 2 start late) and a query block after a cached prefix."""
    B = 3
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).expand(B, 1, Tq, Tk).clone()
    allowed[0, :, :, :2] = False
    allowed[2, :, :, :4] = False
    allowed[..., -1:] |= True  # every row attends to something
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)
    same(Attn(groups=2), *qkv(B, 4, 2, Tq, Tk), mask)


def test_bf16_computes_in_fp32_and_returns_bf16():
    same(Attn(), *qkv(2, 2, 2, 13, 13), None, dtype=torch.bfloat16)


def left_padded(B, Tq, Tk, kind="bool"):
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).expand(B, 1, Tq, Tk).clone()
    allowed[0, :, :, :3] = False
    allowed[..., -1:] |= True  # every row attends to something
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("H,Hkv,Tq,Tk,kind", [
    (4, 4, 20, 20, None), (4, 2, 33, 33, "bool"), (4, 2, 17, 40, "float"),
    (6, 3, 1, 30, "bool"), (2, 2, 57, 57, "bool")])
def test_bf16_written_out_matches_the_kernel(H, Hkv, Tq, Tk, kind):
    """More than 16 keys at head dim 32: bf16 matmuls with an fp32 softmax, to bf16
    rounding of HF's SDPA (causal without a mask, both kinds of mask, grouped heads)."""
    q, k, v = qkv(2, H, Hkv, Tq, Tk, D=32)
    assert _written_out(q, k, {})
    same(Attn(groups=H // Hkv), q, k, v, None if kind is None else left_padded(2, Tq, Tk, kind),
         dtype=torch.bfloat16)


def test_the_kernel_keeps_what_it_is_faster_at():
    q, k, _ = qkv(2, 4, 4, 16, 16, D=32)
    assert not _written_out(q, k, {})  # one block of 16 keys
    q, k, _ = qkv(2, 4, 4, 40, 40, D=16)
    assert not _written_out(q, k, {})  # head dim 16
    q, k, _ = qkv(2, 4, 4, 40, 40, D=32)
    assert not _written_out(q, k, {"dropout": 0.1})
    assert not _written_out(q, k, {"softcap": 30.0})


def test_a_query_that_may_attend_to_nothing_stays_finite():
    """A padding position's query row (all keys masked) gets even weights, not NaN: a NaN
    there would reach real rows through the next layer's keys and values."""
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in qkv(2, 4, 4, 20, 20, D=32))
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool).tril()
    mask[0, :, :, :3] = False  # rows 0-2 of sample 0 see nothing
    out, _ = _bf16_attention(Attn(), q, k, v, mask)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(t.grad.float()).all() for t in (q, k, v))


def test_non_causal_attention_without_a_mask_is_left_alone():
    same(Attn(causal=False), *qkv(2, 2, 2, 9, 9), None)


def test_a_model_switched_to_it_gives_the_same_logits():
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)).eval()
    ours = copy.deepcopy(lm)
    cpu_attention(ours)
    assert ours.config._attn_implementation == CPU_SDPA
    ids = torch.randint(1, 32, (4, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids2, mask2, pos = sequence_inputs(ids, mask, ids[:, :6], torch.ones_like(ids[:, :6]))
    for m in (mask2, torch.ones_like(mask2)):  # left padding; none (HF drops the mask)
        want = lm(input_ids=ids2, attention_mask=m, position_ids=pos).logits
        got = ours(input_ids=ids2, attention_mask=m, position_ids=pos).logits
        assert torch.allclose(got, want, atol=1e-5)
