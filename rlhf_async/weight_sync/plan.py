"""Bucket layout of one weight update, and its plain-dict form (the "plan").

Why: the broadcast must not issue one collective per tensor (thousands of small messages
would dominate), nor need one buffer as large as the model on the sender. All tensors are
laid end to end, as raw bytes, in one logical byte stream (each start aligned to
`ALIGN` bytes so a slice can be viewed back as its dtype); the stream is cut into buckets of
`bucket_bytes`. Mixed dtypes share buckets because buckets are bytes. A tensor larger than a
bucket is simply split across consecutive buckets, so the sender's memory stays two
buckets whatever the largest tensor is.

The plan (names, dtypes, shapes, offsets, bucket sizes, version) is a msgpack-able dict the
caller ships over ZeroMQ once per update; the receiver rebuilds the same layout from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf_async.weight_sync.errors import WeightSyncPlanError

PLAN_FORMAT = 1
ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset in the stream
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every tensor sits in the byte stream; same on sender and receivers."""

    slots: tuple[TensorSlot, ...]
    bucket_bytes: int
    total_bytes: int
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, slot name): a tied weight, sent once

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """(start, size) of every bucket in the stream."""
        b = self.bucket_bytes
        return [(lo, min(b, self.total_bytes - lo)) for lo in range(0, self.total_bytes, b)]

    @property
    def signature(self) -> tuple[tuple[Any, ...], ...]:
        return tuple((s.name, s.dtype, s.shape) for s in self.slots) + self.aliases


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_layout(tensors: Mapping[str, torch.Tensor], bucket_bytes: int,
                 tied: Mapping[str, str] | None = None) -> Layout:
    """Lay `tensors` out in insertion order; a tensor that is another's storage (or named
    in `tied` as alias -> source, for meta tensors) takes no bytes, only an alias."""
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise WeightSyncPlanError(f"bucket size must be a positive multiple of {ALIGN} bytes")
    slots, offset = [], 0
    bad = [f"{n}: {t.dtype}" for n, t in tensors.items() if t.dtype not in _DTYPE_NAMES]
    if bad:
        raise WeightSyncPlanError(
            f"unsupported dtypes for weight sync: {', '.join(bad)} (accepted: {', '.join(DTYPES)})"
        )
    aliases = _aliases(tensors, tied or {})
    for name, t in tensors.items():
        if name in aliases:
            continue
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return Layout(tuple(slots), bucket_bytes, offset, tuple(aliases.items()))


def _aliases(tensors: Mapping[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, str]:
    """alias -> the first name of the same tensor (same storage, offset, shape, strides)."""
    out: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        source = tied.get(name)
        if source is not None and source in tensors and source not in tied:
            out[name] = source
            continue
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
               t.stride())
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """alias -> source of the module's tied state-dict entries (e.g. lm_head.weight ->
    model.embed_tokens.weight), by tensor identity, so it works for sharded parameters."""
    out: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def plan_dict(layout: Layout, version: int, group: str, *, update_id: str = "",
              base: str | None = None) -> dict[str, Any]:
    """The msgpack-able plan shipped to receivers over ZeroMQ. `update_id` names this
    update; `base` (a delta update) names the update the receivers must hold."""
    return {
        "id": update_id,
        "base": base,
        "aliases": [list(a) for a in layout.aliases],
        "format": PLAN_FORMAT,
        "version": version,
        "group": group,
        "bucket_bytes": layout.bucket_bytes,
        "total_bytes": layout.total_bytes,
        "buckets": [[lo, size] for lo, size in layout.buckets],
        "tensors": [
            {
                "name": s.name,
                "dtype": _DTYPE_NAMES[s.dtype],
                "shape": list(s.shape),
                "offset": s.offset,
            }
            for s in layout.slots
        ],
    }


def parse_plan(plan: Mapping[str, Any]) -> tuple[int, str, Layout]:
    """Validate a plan received from the network; returns (version, group, layout)."""
    try:
        if plan["format"] != PLAN_FORMAT:
            raise ValueError(f"format {plan['format']!r} not understood (accepted: {PLAN_FORMAT})")
        version, group = int(plan["version"]), str(plan["group"])
        bucket_bytes, total = int(plan["bucket_bytes"]), int(plan["total_bytes"])
        slots = tuple(_parse_slot(entry) for entry in plan["tensors"])
        aliases = tuple((str(a), str(b)) for a, b in plan.get("aliases", ()))
        names = {s.name for s in slots}
        if any(b not in names or a in names for a, b in aliases):
            raise ValueError("an alias must name a tensor of the plan and not be one")
        layout = Layout(slots, bucket_bytes, total, aliases)
        if version < 0 or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise ValueError("version must be >= 0 and bucket_bytes a multiple of 64")
        expected = build_layout_from_slots(slots, bucket_bytes)
        if expected.total_bytes != total or [list(b) for b in plan["buckets"]] != [
            list(b) for b in layout.buckets
        ]:
            raise ValueError("offsets, total_bytes or buckets disagree with the tensor list")
        if [s.offset for s in expected.slots] != [s.offset for s in slots]:
            raise ValueError("tensor offsets disagree with the layout rule")
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncPlanError(f"malformed weight-sync plan: {exc!r}") from None
    return version, group, layout


def delta_of(plan: Mapping[str, Any]) -> tuple[str, str | None]:
    """(this update's id, the id of the update a delta is against, or None: full)."""
    base = plan.get("base")
    return str(plan.get("id", "")), None if base is None else str(base)


def _parse_slot(entry: Mapping[str, Any]) -> TensorSlot:
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"dtype {entry['dtype']!r} (accepted: {', '.join(DTYPES)})")
    shape = tuple(int(d) for d in entry["shape"])
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in {entry['name']!r}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return TensorSlot(str(entry["name"]), dtype, shape, int(entry["offset"]), nbytes)


def build_layout_from_slots(slots: tuple[TensorSlot, ...], bucket_bytes: int) -> Layout:
    offset, placed = 0, []
    for s in slots:
        placed.append(dataclasses.replace(s, offset=offset))
        offset = _align(offset + s.nbytes)
    return Layout(tuple(placed), bucket_bytes, offset)


def pieces_per_bucket(layout: Layout) -> list[list[tuple[int, int, int, int]]]:
    """For each bucket: (slot index, src byte lo, src byte hi, dst byte lo in bucket)."""
    out: list[list[tuple[int, int, int, int]]] = []
    first = 0  # slots are sorted by offset, so one sweep visits each overlap once
    for lo, size in layout.buckets:
        hi, pieces = lo + size, []
        i = first
        while i < len(layout.slots) and layout.slots[i].offset < hi:
            s = layout.slots[i]
            a, b = max(lo, s.offset), min(hi, s.offset + s.nbytes)
            if a < b:
                pieces.append((i, a - s.offset, b - s.offset, a - lo))
            if s.offset + s.nbytes <= hi:
                first = i + 1
            i += 1
        out.append(pieces)
    return out


def pack_bucket(
    buf: torch.Tensor,
    pieces: list[tuple[int, int, int, int]],
    sources: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
) -> None:
    """Copy one bucket's pieces (from `pieces_per_bucket`) of the byte `sources` into `buf`."""
    for k, src_lo, src_hi, dst in pieces:
        buf[dst : dst + src_hi - src_lo].copy_(sources[k][src_lo:src_hi])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat uint8 view (copies only if not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]


def views(staging: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Typed views of every tensor inside a received byte stream (no copy); an alias is
    the same view as its source."""
    out = {
        s.name: staging[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
        for s in layout.slots
    }
    return out | {alias: out[source] for alias, source in layout.aliases}
