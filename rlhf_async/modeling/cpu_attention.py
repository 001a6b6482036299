"""HF models' SDPA attention, made fast on CPU; unchanged on GPUs.

Two measured pathologies of torch's CPU attention kernel (bench/README.md, "CPU attention"):

- **bf16 is slower than fp32**, 4x in the backward, while bf16 matmuls run up to 4x faster
  than fp32 ones on CPUs with AVX-512 BF16. A bf16 call whose scores are few (the short
  sequences CPU jobs run) and whose shape the kernel loses at (more than 16 keys, head
  dims from 32) is written out: the two matmuls in bf16, scale, mask and softmax in fp32,
  as GPU attention kernels do. Forward and backward at 32 x 6 heads x 57 positions x 64
  dims: 7.5 against 12.4 ms for the kernel in fp32 (bench/README.md, "bf16 attention").
  Other bf16 calls compute in fp32 through the kernel and return bf16.
- **Lengths off a multiple of 16 are slow** at small head dims: the kernel's tail
  handling costs more than the tail. At 32 x 4 heads x 16 dims, one forward took 523 us at
  15 positions and 195 us at 16; 1063 at 31 and 406 at 32; 2076 at 63 and 906 at 64.
  Queries and keys are padded to the next multiple of 16 with positions nobody attends to
  when that is at most 3 away (further off, the extra block cost more than the tail: 56 ->
  64 was 4% slower) and the head dim is at most 32, and the padded rows dropped from the
  output: the same function, to float rounding. From 64 dims the padding's copies cost
  more than the tail saves: fwd + bwd 0.75-0.98x at 64 dims, 0.74-0.80x at 128
  (docs/benchmarks/cpu.md, "CPU attention").

`cpu_attention(module)` switches every HF model inside `module` that attends with "sdpa"
to this function; other implementations, and transformers without the attention
registries, are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

try:  # transformers >= 4.53: attention and its mask chosen by name from registries
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError:  # pragma: no cover - older transformers: attention stays as it is
    AttentionInterface = None  # type: ignore[assignment,misc]

CPU_SDPA = "sdpa_cpu"
WIDTH = 16  # positions the CPU kernel handles at full speed: pad lengths to a multiple
MAX_PAD = 3  # ... when at most this many short (measured: docs/benchmarks/cpu.md)
MAX_PAD_HEAD_DIM = 32  # ... and only at head dims up to this (from 64 padding loses)
MAX_SCORES = 1 << 22  # bf16 calls with at most this many scores are written out (16 MB fp32)
MIN_HEAD_DIM = 32  # ... at head dims from this (bench/README.md, "bf16 attention")


def _padding(length: int, head_dim: int) -> int:
    """Positions to add to `length`: up to the next multiple of WIDTH when that is at most
    MAX_PAD away and `head_dim` at most MAX_PAD_HEAD_DIM. Further off, the extra block costs
    more than the tail it replaces; at larger head dims, the padding's copies do."""
    pad = -length % WIDTH
    return pad if pad <= MAX_PAD and head_dim <= MAX_PAD_HEAD_DIM else 0


def _pad_mask(mask: Tensor, rows: int, cols: int) -> Tensor:
    """`mask` [B, H, Tq, Tk] (bool: True = attend; float: added to the scores) with `cols`
    key positions nobody attends to and `rows` query rows that attend to every key (their
    outputs are dropped; a row attending to nothing would give NaN in the backward)."""
    B, H, Tq, Tk = mask.shape
    if mask.dtype == torch.bool:
        out = mask.new_zeros((B, H, Tq + rows, Tk + cols))
        out[:, :, Tq:] = True
    else:
        out = mask.new_full((B, H, Tq + rows, Tk + cols), torch.finfo(mask.dtype).min)
        out[:, :, Tq:] = 0.0
    out[:, :, :Tq, :Tk] = mask
    return out


def _padded_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """SDPA on lengths padded to a multiple of WIDTH. query [B, H, Tq, D], key and value
    [B, Hkv, Tk, D]; -> [B, Tq, H, D], as HF's."""
    Tq, Tk, D = query.shape[2], key.shape[2], query.shape[3]
    rows = 0 if Tq == 1 else _padding(Tq, D)
    cols = _padding(Tk, D)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    # without a mask only causal self-attention over 2+ positions pads safely (queries and
    # keys alike): no real query sees a pad key
    plain = kwargs.get("position_bias") is not None or (
        attention_mask is None and (not causal or Tq != Tk or rows != cols))
    if plain or (rows == 0 and cols == 0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        attention_mask = _pad_mask(attention_mask, rows, cols)
    query = torch.nn.functional.pad(query, (0, 0, 0, rows))
    key = torch.nn.functional.pad(key, (0, 0, 0, cols))
    value = torch.nn.functional.pad(value, (0, 0, 0, cols))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[:, :Tq], weights


def _written_out(query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a bf16 call runs `_bf16_attention`: no dropout or extra terms, scores that
    fit in MAX_SCORES, and a shape it wins at: more keys than one block of the kernel
    (which wins up to WIDTH, padded) and head dims from MIN_HEAD_DIM (at 16 the kernel won).
    """
    B, H, Tq, D = query.shape
    Tk = key.shape[2]
    extra = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux"))
    return not extra and not kwargs.get("dropout") and D >= MIN_HEAD_DIM and Tk > WIDTH \
        and B * H * Tq * Tk <= MAX_SCORES


def _bf16_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, scaling: float | None = None,
                    is_causal: bool | None = None, **_: Any) -> tuple[Tensor, None]:
    """Attention written out for bf16 on CPU: query [B, H, Tq, D], key and value
    [B, Hkv, Tk, D]; scores and the weighted sum are bf16 matmuls (fp32 accumulation),
    scale, mask and softmax fp32. A query row that may attend to nothing gets even weights
    instead of NaN (its output is a padding position's, never read). -> [B, Tq, H, D]."""
    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    G = H // Hkv  # query heads per key/value head, folded into rows
    q = query.reshape(B, Hkv, G * Tq, D)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().view(B, Hkv, G, Tq, Tk)
    scores = scores * (D ** -0.5 if scaling is None else scaling)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    low = torch.finfo(torch.float32).min
    if attention_mask is not None:
        m = attention_mask[:, :, None] if attention_mask.shape[1] == 1 else \
            attention_mask.view(attention_mask.shape[0], Hkv, G, Tq, Tk)  # [B|1, Hkv|1, G|1, ...]
        scores = scores.masked_fill(~m, low) if m.dtype == torch.bool else scores + m.float()
    elif causal and Tq > 1:  # as SDPA's is_causal: query i sees keys 0..i
        seen = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~seen, low)
    weights = scores.softmax(dim=-1).to(value.dtype).view(B, Hkv, G * Tq, Tk)
    out = torch.matmul(weights, value).view(B, H, Tq, D)
    return out.transpose(1, 2).contiguous(), None


def _cpu_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
              attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """HF's SDPA attention; on CPU padded to the kernel's width, and for bf16 written out
    (small scores) or in fp32 (outside autocast, which would cast it back; returned as
    bf16)."""
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.dtype != torch.bfloat16:
        return _padded_sdpa(module, query, key, value, attention_mask, **kwargs)
    if _written_out(query, key, kwargs):
        with torch.autocast("cpu", enabled=False):
            return _bf16_attention(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = _padded_sdpa(module, query.float(), key.float(), value.float(),
                                    attention_mask, **kwargs)
    return out.to(query.dtype), weights


def cpu_attention(module: nn.Module) -> None:
    """Switch every HF model in `module` (itself, a trunk, a wrapped model) that attends
    with SDPA to `_cpu_sdpa` (see the module)."""
    if AttentionInterface is None:
        return
    for m in module.modules():
        name = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if name == "sdpa" and hasattr(m, "set_attn_implementation"):
            if CPU_SDPA not in AttentionInterface._global_mapping:
                AttentionInterface.register(CPU_SDPA, _cpu_sdpa)
                AttentionMaskInterface.register(CPU_SDPA, sdpa_mask)
            m.set_attn_implementation(CPU_SDPA)  # type: ignore[operator]  # HF's
