"""Bucketed broadcast of actor weights: trainer rank 0 -> every generator (gloo or NCCL).

Why this shape: the sender packs the byte stream of `plan.py` into two reusable bucket
buffers and keeps one broadcast in flight while packing the next bucket, so the copy cost
hides behind the wire. Receivers land every bucket straight in one staging buffer as large
as the model and only then expose the weights, so a transfer that fails half way never
leaves a generator with a mix of two versions. The same code serves gloo (CPU tensors) and
NCCL (CUDA tensors); only the device of the buffers and the backend object differ.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import structlog
import torch

from rlhf_async.weight_sync.encoded import receive_bucket
from rlhf_async.weight_sync.errors import (
    WeightSyncBaseMismatch,
    WeightSyncError,
    WeightSyncPlanError,
)
from rlhf_async.weight_sync.group import BroadcastGroup, open_store
from rlhf_async.weight_sync.module import load_into_module
from rlhf_async.weight_sync.plan import (
    ALIGN,
    Layout,
    build_layout,
    delta_of,
    parse_plan,
    pieces_per_bucket,
    plan_dict,
    views,
)
from rlhf_async.weight_sync.spec import GroupSpec
from rlhf_async.weight_sync.stream import SendStream, check_matches

# A lazy proxy: picks up configure_logging() even when called after this import.
log = structlog.get_logger(component="weight_sync")

DEFAULT_BUCKET_MB = 100.0  # the paper's ~100 MB buckets; config weight_sync.bucket_mb


@dataclasses.dataclass
class ReceivedWeights:
    """Weights of one update, as views into the receiver's staging buffer.

    Valid until the next `receive` on the same receiver: apply them first.
    """

    version: int
    tensors: dict[str, torch.Tensor]

    def load_into(self, module: torch.nn.Module, *, strict: bool = True) -> int:
        """Copy into `module` by name (all-or-nothing); returns the new version."""
        load_into_module(module, self.tensors, strict=strict)
        return self.version


def _default_device(backend: str, device: torch.device | str | None) -> torch.device:
    if backend == "gloo":
        # gloo moves host memory: a CUDA model's weights are packed into (and loaded from)
        # CPU buffers, the way two processes sharing one GPU (which NCCL refuses) sync
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_device(backend: str, device: torch.device) -> None:
    if backend == "nccl" and device.type != "cuda":
        raise WeightSyncError(f"backend 'nccl' needs a CUDA device, got {device}")


class TorchBroadcastSender:
    """Rank 0 of the group. Order: prepare -> connect -> (plan -> send)* -> close."""

    def __init__(
        self,
        backend: str = "gloo",
        *,
        device: torch.device | str | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        delta: bool = False,
    ) -> None:
        self.backend = backend
        self.delta = delta
        self.device = _default_device(backend, device)
        _check_device(backend, self.device)
        if not bucket_mb > 0:
            raise WeightSyncError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.bucket_bytes = max(ALIGN, int(bucket_mb * 2**20) // ALIGN * ALIGN)
        self.buffers_allocated = 0
        self.largest_group_bytes = 0  # of the last send: source bytes held at once
        self._store: torch.distributed.TCPStore | None = None
        self._group: BroadcastGroup | None = None
        self._layout: Layout | None = None
        self._pieces: list[list[tuple[int, int, int, int]]] = []
        self._buffers: list[torch.Tensor] = []
        # delta: a copy of the last sent version's bytes (one model in the shadow dtype)
        self._prev: torch.Tensor | None = None
        self._prev_id: str | None = None  # the update those bytes are; None: none complete
        self._updates = 0  # sends begun: with the nonce, names each update
        self._nonce = uuid.uuid4().hex[:12]  # a restarted trainer's ids are new
        self.full_fallbacks = 0  # updates sent whole though delta is on (after the first)
        self.last_sent_bytes = 0  # on the wire in the last send (headers included)
        self.last_full_bytes = 0  # what a full update of the same weights is

    def prepare(self, spec: GroupSpec) -> GroupSpec:
        """Host the rendezvous store (once); returns the spec with the real port to ship."""
        if spec.backend != self.backend:
            raise WeightSyncError(f"spec backend {spec.backend!r} != sender's {self.backend!r}")
        if self._store is None or spec.master_port not in (0, self._store.port):
            self._store = open_store(spec, is_master=True, who=spec.describe(0))
        return dataclasses.replace(spec, master_port=self._store.port)

    def connect(self, spec: GroupSpec) -> None:
        """Build (or rebuild, for a new epoch) the group; blocks until every rank joined."""
        spec = self.prepare(spec)
        if self._group is not None:
            self._group.close()
            self._group = None
        self._prev_id = None  # a regrouped receiver may hold anything: next update is full
        assert self._store is not None
        self._group = BroadcastGroup(self._store, spec, 0, self.device)

    def plan(self, tensors: Mapping[str, torch.Tensor], version: int,
             tied: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Plan of one update, to ship to every receiver before (or while) calling `send`.
        `tied` (alias -> source, see `tied_names`) names tied weights the meta tensors of a
        layout cannot show; they travel once. With delta on, the update is a delta against
        the last one sent when every receiver holds it (same group incarnation and layout)."""
        group = self._require_group()
        layout = build_layout(tensors, self.bucket_bytes, tied)
        if self._layout is None or layout.signature != self._layout.signature:
            self._layout, self._pieces = layout, pieces_per_bucket(layout)
            self._prev_id = None
        base = self._prev_id if self.delta else None
        return plan_dict(self._layout, version, group.spec.group_name,
                         update_id=f"{self._nonce}.{self._updates}", base=base)

    def send(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
        plan: Mapping[str, Any],
    ) -> None:
        """Broadcast the tensors laid out by `plan` (from this sender's `plan`): one mapping,
        or consecutive groups of it in plan order, e.g. a ZeRO-3 model gathered a group at a
        time. A group is finished with before the next is asked for: every bucket it
        completes is broadcast (a bucket spanning two groups is packed from both), and
        broadcasts that read its memory in place are waited for, so the caller may free it."""
        group, layout = self._require_group(), self._layout
        if layout is None or plan.get("group") != group.spec.group_name:
            raise WeightSyncPlanError("send() needs a plan made by this sender's plan()")
        update_id, base = delta_of(plan)
        if base is not None and base != self._prev_id:
            raise WeightSyncPlanError("send() got a delta plan whose base is not the last "
                                      "update sent: make a new plan")
        aliases = dict(layout.aliases)
        if isinstance(tensors, Mapping):
            tensors = {k: t for k, t in tensors.items() if k not in aliases}
            check_matches(layout, tensors)  # every problem at once, before any transfer
        self._ensure_buffers(min(self.bucket_bytes, layout.total_bytes))
        prev = self._ensure_prev(layout.total_bytes)
        stream = SendStream(group, layout, self._pieces, self._buffers, plan["version"], prev,
                         encode=base is not None)
        self._prev_id = None  # the base copy is being overwritten
        self._updates += 1
        with torch.no_grad():
            for part in [tensors] if isinstance(tensors, Mapping) else tensors:
                stream.add({k: t.to(self.device) for k, t in part.items() if k not in aliases})
            stream.finish()
        self._prev_id = update_id if self.delta else None
        self.full_fallbacks += int(self.delta and base is None and self._updates > 1)
        self.largest_group_bytes = stream.largest_group_bytes
        self.last_sent_bytes, self.last_full_bytes = stream.sent_bytes, layout.total_bytes
        log.debug("weights_sent", version=plan["version"], bytes=stream.sent_bytes,
                  full_bytes=layout.total_bytes, delta=base is not None,
                  buckets=len(self._pieces), largest_group_bytes=stream.largest_group_bytes)

    def _ensure_prev(self, nbytes: int) -> torch.Tensor | None:
        if not self.delta:
            return None
        if self._prev is None or self._prev.numel() != nbytes:
            self._prev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._prev_id = None
        return self._prev

    def _ensure_buffers(self, nbytes: int) -> None:
        if self._buffers and self._buffers[0].numel() >= nbytes:
            return
        # zeroed: alignment gaps keep the same bytes every update, so a delta skips them
        self._buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in "ab"]
        self.buffers_allocated += 1

    def _require_group(self) -> BroadcastGroup:
        if self._group is None:
            raise WeightSyncError("weight sender is not connected: call connect(spec) first")
        return self._group

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._store = None, None


class TorchBroadcastReceiver:
    """A generator's end. Order: connect -> (receive -> load_into)* -> close."""

    def __init__(self, backend: str = "gloo", *, device: torch.device | str | None = None) -> None:
        self.backend = backend
        self.device = _default_device(backend, device)
        _check_device(backend, self.device)
        self.buffers_allocated = 0
        self._store: torch.distributed.TCPStore | None = None
        self._store_addr: tuple[str, int] | None = None
        self._group: BroadcastGroup | None = None
        self._staging: torch.Tensor | None = None
        self._held: str | None = None  # id of the update the staging buffer holds whole

    def connect(self, spec: GroupSpec, rank: int) -> None:
        """Join the group as `rank` (>= 1); blocks until every rank joined or times out.

        Start it on the generators before the trainer's `connect` (in a thread from async
        code) so no side waits on a reply from the other while holding the rendezvous.
        """
        if spec.backend != self.backend:
            raise WeightSyncError(f"spec backend {spec.backend!r} != receiver's {self.backend!r}")
        if rank < 1:
            raise WeightSyncError(f"receivers take ranks >= 1 (rank 0 is the sender), got {rank}")
        if self._group is not None:
            self._group.close()
            self._group = None
        addr = (spec.master_addr, spec.master_port)
        cached = self._store is not None and self._store_addr == addr
        for fresh in ((False, True) if cached else (True,)):
            if fresh:
                self._store = open_store(spec, is_master=False, who=spec.describe(rank))
                self._store_addr = addr
            assert self._store is not None
            try:
                self._group = BroadcastGroup(self._store, spec, rank, self.device)
                return
            except torch.distributed.DistNetworkError as exc:  # the store is gone (a
                self._store, lost = None, exc  # restarted trainer's may reuse its port)
        raise WeightSyncError(f"{spec.describe(rank)} lost the weight-sync store at "
                              f"{spec.master_addr}:{spec.master_port}: {lost}")

    def receive(self, plan: Mapping[str, Any]) -> ReceivedWeights:
        """Receive one update described by `plan`; returns it once every bucket arrived."""
        version, group_name, layout = parse_plan(plan)
        group = self._group
        if group is None:
            raise WeightSyncError("weight receiver is not connected: call connect(spec, rank)")
        if group_name != group.spec.group_name:
            raise WeightSyncPlanError(
                f"plan is for weight-sync group '{group_name}', this receiver is in "
                f"'{group.spec.group_name}'"
            )
        update_id, base = delta_of(plan)
        held = self._held
        has_base = base is not None and base == held
        if not has_base:
            self._held = None  # a full update, or a delta this receiver cannot apply
        staging = self._ensure_staging(layout.total_bytes)
        buckets = layout.buckets
        labels = [f"receive of bucket {i + 1}/{len(buckets)} (v{version})"
                  for i in range(len(buckets))]
        if base is None:
            works = [group.broadcast(staging[lo : lo + size]) for lo, size in buckets]
            for work, label in zip(works, labels, strict=True):
                group.wait(work, label)
        else:  # every bucket is taken, even a useless one, so the collective stays in step
            self._held = None
            found = [receive_bucket(group, staging[lo : lo + size], has_base, label)
                        for (lo, size), label in zip(buckets, labels, strict=True)]
            problems = [p for p in found if p is not None]
            if not has_base or problems:
                raise WeightSyncBaseMismatch(
                    f"delta update v{version} is against update {base}, this receiver held "
                    f"{held or 'none'}"
                    + (f" ({'; '.join(problems)})" if problems else "")
                    + ": nothing applied, a full update is needed")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._held = update_id or None
        return ReceivedWeights(version, views(staging, layout))

    def _ensure_staging(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.buffers_allocated += 1
            self._held = None
        return self._staging

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._store, self._store_addr = None, None, None
