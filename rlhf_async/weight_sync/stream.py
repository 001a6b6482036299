"""The sender's side of one weight update: the plan's byte stream walked a group of tensors
at a time, each completed bucket broadcast (in place when it lies inside one tensor, else
packed into one of two bucket buffers, so that one broadcast is on the wire while the next
bucket is packed), raw or encoded against the base the receivers hold (delta sync).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlhf_async.weight_sync.encoded import send_bucket
from rlhf_async.weight_sync.errors import WeightSyncPlanError
from rlhf_async.weight_sync.group import BroadcastGroup
from rlhf_async.weight_sync.plan import Layout, as_bytes, pack_bucket


def check_matches(layout: Layout, tensors: Mapping[str, torch.Tensor], start: int = 0) -> None:
    """`tensors` must be the plan's slots start, start+1, ... (names, order, dtypes, shapes)."""
    slots = layout.slots[start : start + len(tensors)]
    problems = []
    if list(tensors) != [s.name for s in slots]:
        problems.append("tensor names or their order differ from the plan")
    else:
        for s in slots:
            t = tensors[s.name]
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                problems.append(
                    f"{s.name}: {t.dtype}{list(t.shape)} vs plan {s.dtype}{list(s.shape)}"
                )
    if problems:
        raise WeightSyncPlanError(
            "send() got tensors that do not match the plan: " + "; ".join(problems)
        )


class SendStream:
    """One `send`'s way through the plan's byte stream, a group of tensors at a time."""

    def __init__(self, group: BroadcastGroup, layout: Layout,
                 pieces: list[list[tuple[int, int, int, int]]], buffers: list[torch.Tensor],
                 version: int, prev: torch.Tensor | None = None, encode: bool = False) -> None:
        self.group, self.layout, self.pieces, self.buffers = group, layout, pieces, buffers
        self.version = version
        self.prev, self.encode = prev, encode  # the base's bytes; send deltas against it
        self.sent_bytes = 0
        self.k = self.i = self.j = 0  # next slot to arrive; next bucket; next piece of it
        self.slot = 0  # the bucket buffer to pack next
        self.slot_work: list[tuple[torch.distributed.Work, str] | None] = [None, None]
        self.pending: list[tuple[torch.distributed.Work, str]] = []  # from the buffers
        self.largest_group_bytes = 0

    def add(self, part: Mapping[str, torch.Tensor]) -> None:
        """Take the next group, broadcast every bucket it completes, and return only once
        nothing reads its memory any more (so the caller may free it)."""
        nslots = len(self.layout.slots)
        if self.k + len(part) > nslots:
            raise WeightSyncPlanError(f"send() got more tensors than the plan's {nslots}")
        check_matches(self.layout, part, self.k)
        sources = {self.k + n: as_bytes(t) for n, t in enumerate(part.values())}  # [nbytes]
        self.k += len(part)
        self.largest_group_bytes = max(self.largest_group_bytes,
                                       sum(b.numel() for b in sources.values()))
        # a Work keeps its tensor alive: in-place broadcasts of this group are waited for
        # and dropped here, or no group's memory would be freed before the send ends
        in_place = []
        while self.i < len(self.pieces):
            label = f"broadcast of bucket {self.i + 1}/{len(self.pieces)} (v{self.version})"
            pieces, size = self.pieces[self.i], self.layout.buckets[self.i][1]
            if self.j == 0 and pieces and pieces[0][0] >= self.k:
                break  # nothing of this bucket has arrived yet
            if len(pieces) == 1 and pieces[0][2] - pieces[0][1] == size:
                # The bucket lies inside one tensor: send its bytes in place, no copy.
                k, src_lo, src_hi, _ = pieces[0]
                in_place += self._emit(sources[k][src_lo:src_hi], label)
                self.i += 1
                continue
            busy = self.slot_work[self.slot]
            if self.j == 0 and busy is not None:  # that buffer may still be on the wire
                self.group.wait(*busy)
            ready = [p for p in pieces[self.j :] if p[0] < self.k]
            pack_bucket(self.buffers[self.slot][:size], ready, sources)
            self.j += len(ready)
            if self.j < len(pieces):
                break  # the rest of this bucket comes with the next group
            works = self._emit(self.buffers[self.slot][:size], label)
            self.slot_work[self.slot] = works[-1]
            self.pending += works
            self.slot, self.i, self.j = self.slot ^ 1, self.i + 1, 0
        for work, what in in_place:
            self.group.wait(work, what)

    def _emit(self, data: torch.Tensor, label: str) -> list[tuple[torch.distributed.Work, str]]:
        """Put bucket `self.i`'s bytes on the wire: raw, or encoded against the base; the
        base copy (when kept) becomes these bytes."""
        lo, size = self.layout.buckets[self.i]
        if self.encode:
            assert self.prev is not None
            works, nbytes = send_bucket(self.group, data, self.prev[lo : lo + size], label)
            self.sent_bytes += nbytes
            return works
        if self.prev is not None:
            self.prev[lo : lo + size].copy_(data)
        self.sent_bytes += size
        return [(self.group.broadcast(data), label)]

    def finish(self) -> None:
        if self.k != len(self.layout.slots):
            raise WeightSyncPlanError(
                f"send() got {self.k} of the plan's {len(self.layout.slots)} tensors")
        for work, what in self.pending:
            self.group.wait(work, what)
