"""Keyed randomness, so that results do not depend on placement.

Every random draw that shapes a result is keyed by (seed, purpose, step, sample id) rather
than by a process's RNG state; statistics over "the batch" are reduced over all ranks by
`modeling/collectives.py`.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import Tensor


def key_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed derived from (seed, *parts); stable across processes and runs."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", seed))
    for p in parts:
        h.update(str(p).encode() + b"\x00")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def keyed_generator(seed: int, *parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(key_seed(seed, *parts))


def keyed_uniform(seed: int, parts: tuple[int | str, ...], sample_ids: list[int],
                  shape: tuple[int, ...]) -> Tensor:
    """[len(sample_ids), *shape] uniforms in (0, 1); row i depends only on its own sample id."""
    rows = [seeded_uniform(key_seed(seed, *parts, int(s)), shape) for s in sample_ids]
    return torch.stack(rows) if rows else torch.empty((0, *shape), dtype=torch.float64)


def seeded_uniform(key: int, shape: tuple[int, ...]) -> Tensor:
    """Uniforms in (0, 1) of one stream, fixed by `key` (a `key_seed`)."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(key), dtype=torch.float64)
    return u.clamp(1e-12, 1.0 - 1e-12)


def keyed_order(seed: int, parts: tuple[int | str, ...], ids: list[int]) -> list[int]:
    """A permutation of `ids` fixed by the key and the ids themselves, not by their order."""
    return sorted(ids, key=lambda i: key_seed(seed, *parts, int(i)))
