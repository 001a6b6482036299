"""Delta encoding of one weight bucket against the previous version's bytes.

Why: between two RL steps at a small learning rate most bf16 values do not change, so a
generator that holds the previous version needs only the changed ones. The codec works on
the bucket's bytes as 16-bit words, which is exact for every dtype (a bf16/fp16 value is one
word, an fp32 value two) and needs no knowledge of the tensors inside the bucket. Per bucket
the smallest of three forms is sent:

- FULL: the raw bytes (the fallback whenever a delta would not be smaller);
- GAPS: the new words + uint8 gaps between their positions; a word of the grid
  every 255 positions is always included (re-sent unchanged) so no gap exceeds 255;
- MASK: the new words + one bit per word (wins above ~1/16 of the words changed);
- STEP: two bits per word (same / +1 / -1 / listed) + the listed new words: most values
  that change in a small optimizer step move by one unit in the last place, which is +-1
  on the 16-bit word.

The receiver writes the new words over its copy of the previous bytes: the result is the
new bucket bit for bit. A checksum of the new bytes travels with every encoded bucket, so a
receiver that held other bytes than the sender's base finds out instead of running on
wrong weights.
"""

from __future__ import annotations

import torch

FULL, GAPS, MASK, STEP = 0, 1, 2, 3
KINDS = {FULL: "full", GAPS: "gaps", MASK: "mask", STEP: "step"}
GRID = 255  # largest gap a uint8 holds


def words(b: torch.Tensor) -> torch.Tensor:
    """A byte buffer (even length) as 16-bit words, no copy."""
    return b.view(torch.int16)  # [n/2]


def checksum(b: torch.Tensor) -> int:
    """63-bit checksum of a byte buffer (even length): a wrapping sum of its 8-byte (else
    2-byte) words plus a weighted sum of every third word, so a moved word shows too; cheap
    (a full pass costs about what a copy does)."""
    x = b.view(torch.int64) if b.numel() % 8 == 0 else words(b).to(torch.int64)  # [m]
    return int((x.sum() + 31 * x[::3].sum() + x.numel()) & ((1 << 62) - 1))


def encode(prev: torch.Tensor, new: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(kind, payload bytes) of `new` given `prev`, both uint8 of the same even length."""
    old_w, new_w = words(prev), words(new)
    n = new_w.numel()
    changed = old_w != new_w  # [n] bool
    count = int(changed.sum())
    mask_bytes = (n + 7) // 8 + 2 * count
    grid = torch.zeros_like(changed)
    grid[GRID - 1 :: GRID] = True
    keep = changed | grid
    kept = int(keep.sum())
    gaps_bytes = 3 * kept
    step = new_w - old_w  # [n], wraps like the bits do
    listed = changed & (step != 1) & (step != -1)
    step_bytes = (n + 3) // 4 + 2 * int(listed.sum())
    if min(mask_bytes, gaps_bytes, step_bytes) >= new.numel():
        return FULL, new
    if step_bytes < min(mask_bytes, gaps_bytes):
        code = (step == 1).to(torch.uint8) + 2 * (step == -1).to(torch.uint8)
        code[listed] = 3
        return STEP, torch.cat([new_w[listed].view(torch.uint8), _pack_pairs(code)])
    if gaps_bytes <= mask_bytes:
        idx = keep.nonzero().squeeze(1)  # [kept] sorted word positions
        gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)).to(torch.uint8)  # 1..255
        return GAPS, torch.cat([new_w[idx].view(torch.uint8), gaps])
    bits = _pack_bits(changed)
    return MASK, torch.cat([new_w[changed].view(torch.uint8), bits])


def decode(kind: int, payload: torch.Tensor, base: torch.Tensor) -> None:
    """Apply `payload` to `base` (the previous bytes of the bucket) in place."""
    if kind == FULL:
        base.copy_(payload)
        return
    w = words(base)
    n = w.numel()
    if kind == GAPS:
        kept = payload.numel() // 3
        idx = payload[2 * kept :].to(torch.int64).cumsum(0) - 1  # [kept]
        w[idx] = payload[: 2 * kept].view(torch.int16)
        return
    if kind == MASK:
        nbits = (n + 7) // 8
        values = payload.numel() - nbits
        changed = _unpack_bits(payload[values:], n)
        w[changed] = payload[:values].view(torch.int16)
        return
    if kind == STEP:
        ncodes = (n + 3) // 4
        values = payload.numel() - ncodes
        code = _unpack_pairs(payload[values:], n)
        w += (code == 1).to(torch.int16) - (code == 2).to(torch.int16)
        w[code == 3] = payload[:values].view(torch.int16)
        return
    raise ValueError(f"unknown delta kind {kind!r} (accepted: {sorted(KINDS)})")


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Byte i of each 8 -> bit i (one multiply gathers the eight 0/1 bytes of an int64)."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    x = padded.view(torch.int64)  # [n/8]
    return (((x * 0x0102040810204080) >> 56) & 0xFF).to(torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    expanded = bits.unsqueeze(1).bitwise_and(_BIT.to(bits.device)).ne(0)  # [n/8, 8]
    return expanded.reshape(-1)[:n]


def _pack_pairs(code: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0..3), four to a byte, code i of each four at bits 2i."""
    n = code.numel()
    padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=code.device)
    padded[:n] = code
    q = padded.view(-1, 4)  # [n/4, 4]
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def _unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:n]  # [n]
