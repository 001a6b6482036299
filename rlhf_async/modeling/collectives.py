"""Global reductions over the ranks of a lock-step job or a multi-rank trainer.

Every statistic over "the batch" is reduced over all ranks. Without torch.distributed the
reductions are no-ops, so one process gives the same numbers as N processes holding shards
of the same global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


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
