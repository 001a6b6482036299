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


class GradBuffer:
    """The gradients of `params` summed over ranks without a copy: on first use each
    parameter's `.grad` becomes a view into one flat buffer per dtype, kept from step to
    step, so backward accumulates into it in place and one all-reduce per buffer sums it.
    Concatenating into a fresh buffer and copying back (540 MB allocated and touched
    twice) made SmolLM2-135M's training step on two CPU ranks 10.4 s instead of 7.7 s
    (bench/README.md). A parameter without a gradient counts as zeros, on every rank
    alike. Identity without torch.distributed."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.flats: list[Tensor] = []

    def _bound(self) -> bool:
        return bool(self.flats) and all(
            p.grad is not None and p.grad.data_ptr() == ptr
            for p, ptr in zip(self.params, self._ptrs, strict=True))

    def _bind(self) -> None:
        """One flat buffer per (dtype, device), holding the current gradients; every
        `.grad` a view into it."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.flats = []
        for (dtype, device), ps in groups.items():
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            offset = 0
            for p in ps:
                view = flat[offset: offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                offset += p.numel()
            self.flats.append(flat)
        self._ptrs = [p.grad.data_ptr() for p in self.params if p.grad is not None]

    def all_reduce(self) -> None:
        """Sum every gradient over ranks, in place (one collective per buffer)."""
        if not is_distributed():
            return
        if not self._bound():
            self._bind()
        for flat in self.flats:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)

    def zero(self) -> bool:
        """Zero the bound buffers in place for the next step's backward; False when they
        are not bound (the caller frees the gradients instead)."""
        if not self._bound():
            return False
        for flat in self.flats:
            flat.zero_()
        return True


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks once (`GradBuffer`: the training engine keeps one)."""
    GradBuffer(params).all_reduce()


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
