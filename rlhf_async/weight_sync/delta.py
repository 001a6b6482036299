"""Delta encoding of one weight bucket against the previous version's bytes.

Why: between two RL steps at a small learning rate most bf16 values do not change, and most
of those that do move by one unit in the last place (+-1 on the 16-bit word), so a
generator that holds the previous version needs far fewer bytes than the bucket. The codec
works on the bucket's bytes as 16-bit words, which is exact for every dtype (a bf16/fp16
value is one word, an fp32 value two) and needs no knowledge of the tensors inside.
Per bucket one of two forms is sent:

- FULL: the raw bytes (the fallback whenever the delta would not be smaller);
- STEP: a 2-bit code per word (-1 / same / +1 / listed), four to a byte, plus the
  differences (new - old, wrapping) of the listed words, all through deflate's
  run-length strategy. Measured on SmolLM2-135M-Instruct in GRPO at lr 3e-5 (~5% of the
  words change per step, bench/README.md): the codes deflate to ~0.45 bits a word, a
  third of their packed size, because the "same" code dominates; the differences to about
  half. A raw-index form (uint8 gaps + values) and a bitmask form measured 2-3x larger at
  every change density we saw and are gone.

The element-wise passes run where the bucket lives (the GPU with NCCL); deflate runs on the
CPU (zlib, which releases the GIL, so the next bucket's passes overlap it). The receiver
adds the steps to its copy of the previous bytes: the result is the new bucket bit for bit.
A checksum of the new bytes travels with every encoded bucket, so a receiver that held
other bytes than the sender's base finds out instead of running on wrong weights.
"""

from __future__ import annotations

import zlib

import torch

FULL, STEP = 0, 3  # the wire's numbers for the forms
KINDS = {FULL: "full", STEP: "step"}
SAME, LISTED = 1, 3  # the codes of an unchanged word and of one whose difference is listed
_SAME4 = 0b01010101  # a byte of four unchanged words
_LEVEL, _WBITS = 1, -15  # raw deflate, no zlib header: the bucket header says what it is


def words(b: torch.Tensor) -> torch.Tensor:
    """A byte buffer (even length) as 16-bit words, no copy."""
    return b.view(torch.int16)  # [n/2]


def checksum(b: torch.Tensor) -> int:
    """63-bit checksum of a byte buffer (even length): a wrapping sum of its 8-byte (else
    2-byte) words plus a weighted sum of every third word, so a moved word shows too; cheap
    (a full pass costs about what a copy does)."""
    x = b.view(torch.int64) if b.numel() % 8 == 0 else words(b).to(torch.int64)  # [m]
    return int((x.sum() + 31 * x[::3].sum() + x.numel()) & ((1 << 62) - 1))


def step_codes(prev: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code per word: 0 = -1, 1 = same, 2 = +1, 3 = listed; the listed words' differences)
    of byte buffers `prev` -> `new` (uint8, same even length)."""
    diff = words(new) - words(prev)  # [n] int16, wraps like the bits do
    # diff + 1 is 0..2 for the steps; below 0 clamps to -1 whose low two bits are 3 (listed)
    code = (diff + 1).clamp_(-1, LISTED).bitwise_and_(3).to(torch.uint8)  # [n]
    return code, diff[code == LISTED]


def encode(prev: torch.Tensor, new: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(kind, payload bytes) of `new` given `prev`, both uint8 of the same even length; a
    STEP payload is on the CPU, a FULL one is `new` itself."""
    code, listed = step_codes(prev, new)
    raw = torch.cat([listed.view(torch.uint8), _pack_pairs(code)]).cpu()  # [2L + n/4]
    packed = _deflate(raw.numpy().data)
    if len(packed) >= new.numel():
        return FULL, new
    return STEP, torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def decode(kind: int, payload: torch.Tensor, base: torch.Tensor) -> None:
    """Apply `payload` to `base` (the previous bytes of the bucket) in place; a payload that
    is not a valid delta of this bucket is a ValueError."""
    if kind == FULL:
        base.copy_(payload)
        return
    if kind != STEP:
        raise ValueError(f"unknown delta kind {kind!r} (accepted: {sorted(KINDS)})")
    w = words(base)
    n = w.numel()
    try:
        raw = zlib.decompress(payload.cpu().numpy().data, _WBITS)
    except zlib.error as exc:
        raise ValueError(f"corrupt step payload ({exc})") from exc
    values = len(raw) - (n + 3) // 4
    if values < 0 or values % 2:
        raise ValueError(f"step payload of {len(raw)} bytes does not fit {n} words")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(base.device)
    packed = data[values:]  # [n/4]
    # only the bytes holding a change are unpacked: four "same" codes are 0b01010101
    hit = (packed != _SAME4).nonzero().squeeze(1)  # [m]
    code = _unpack_pairs(packed[hit], 4 * hit.numel())  # [4m]
    moved = (code != SAME).nonzero().squeeze(1)  # [k]; the padding past n is "same" too
    code, pos = code[moved], hit[moved // 4] * 4 + moved % 4  # [k] in word order
    listed = code == LISTED
    if int(torch.count_nonzero(listed)) * 2 != values:
        raise ValueError(f"step payload lists {values // 2} words, its codes "
                         f"{int(torch.count_nonzero(listed))}")
    vals = w[pos] + (code.to(torch.int16) - 1)  # the steps; a listed word got +2 ...
    vals[listed] += data[:values].view(torch.int16) - 2  # ... taken back here
    w[pos] = vals


def _deflate(raw: memoryview) -> bytes:
    z = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, 9, zlib.Z_RLE)
    return z.compress(raw) + z.flush()


def _pack_pairs(code: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0..3), four to a byte, code i of each four at bits 2i: one multiply
    moves the four bytes of an int32 to bits 24..31 (no carries: the terms below bit 24
    add up to less than 2**24)."""
    n = code.numel()
    padded = torch.full(((n + 3) // 4 * 4,), SAME, dtype=torch.uint8, device=code.device)
    padded[:n] = code
    x = padded.view(torch.int32)  # [n/4]; int32 products wrap, bits 24..31 stay exact
    return ((x * 0x01041040) >> 24).bitwise_and_(0xFF).to(torch.uint8)


def _unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:n]  # [n]
