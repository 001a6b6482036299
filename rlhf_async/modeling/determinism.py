"""Keyed randomness and global reductions, so that results do not depend on placement.

Every random draw that shapes a result is keyed by (seed, purpose, step, sample id) rather
than by a process's RNG state; every statistic over "the batch" is reduced over all ranks.
Without torch.distributed the reductions are no-ops, so one process gives the same numbers
as N processes holding shards of the same global batch.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist
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
    rows = [torch.rand(shape, generator=keyed_generator(seed, *parts, int(s)),
                       dtype=torch.float64) for s in sample_ids]
    out = torch.stack(rows) if rows else torch.empty((0, *shape), dtype=torch.float64)
    return out.clamp(1e-12, 1.0 - 1e-12)


def keyed_order(seed: int, parts: tuple[int | str, ...], ids: list[int]) -> list[int]:
    """A permutation of `ids` fixed by the key and the ids themselves, not by their order."""
    return sorted(ids, key=lambda i: key_seed(seed, *parts, int(i)))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over ranks (a copy); identity without torch.distributed."""
    if not is_distributed():
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather_1d(t: Tensor) -> Tensor:
    """Concatenate a 1-D tensor over ranks in rank order (sizes may differ)."""
    if not is_distributed():
        return t
    world = dist.get_world_size()
    size = torch.tensor([t.numel()], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks in one flat buffer (one collective, not one per tensor)."""
    if not is_distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset: offset + n].view_as(p).clone()
        offset += n


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
