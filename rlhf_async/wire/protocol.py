"""Wire protocol: a msgpack header frame plus one zero-copy frame per tensor. No pickle.

Frames of one message: ``[header, tensor_0, tensor_1, ...]``. The header is a msgpack map
(see `_HEADER_TYPES`); each tensor is described in it by ``[name, dtype, shape, frame]``
where ``frame`` is the index of its frame in the message (1..n, in order). `decode`
validates everything before touching tensor bytes and raises a `ProtocolError` subclass.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

PROTOCOL_VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30  # total declared tensor bytes of one message
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 4096
MAX_NDIM = 16

DATA_KINDS = ("prompts", "rollout", "scored_rollout")
# fenced: coordinator -> a process of an incarnation declared dead (it exits at once)
CONTROL_KINDS = ("register", "ready", "heartbeat", "command", "reply", "event", "stop",
                 "fenced")
_KINDS: set[str] = set(DATA_KINDS + CONTROL_KINDS)

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class ProtocolError(ValueError):
    """A received message was rejected. `reason` is a short stable name for counters."""

    reason = "protocol_error"


class MalformedHeader(ProtocolError):
    reason = "malformed_header"


class VersionMismatch(ProtocolError):
    reason = "version_mismatch"


class UnknownKind(ProtocolError):
    reason = "unknown_kind"


class UnknownDtype(ProtocolError):
    reason = "unknown_dtype"


class FrameCountMismatch(ProtocolError):
    reason = "frame_count"


class FrameSizeMismatch(ProtocolError):
    reason = "frame_size"


class MessageTooLarge(ProtocolError):
    reason = "too_large"


def register_kind(name: str) -> str:
    """Add a message kind to the registry (idempotent); returns the name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"message kind must be a non-empty str, got {name!r}")
    _KINDS.add(name)
    return name


def known_kinds() -> frozenset[str]:
    return frozenset(_KINDS)


_id_prefix = uuid.uuid4().hex[:16]
_id_counter = itertools.count()


def _reset_ids() -> None:
    global _id_prefix, _id_counter
    _id_prefix, _id_counter = uuid.uuid4().hex[:16], itertools.count()


os.register_at_fork(after_in_child=_reset_ids)  # a forked child must not repeat ids


def new_id() -> str:
    """Unique message id: a random per-process prefix plus a counter (cheaper than uuid4)."""
    return f"{_id_prefix}-{next(_id_counter)}"


@dataclass
class Message:
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    id: str = field(default_factory=new_id)
    parent: str | None = None
    source: str = ""
    step: int = 0
    weight_version: int = 0
    timestamp: float = field(default_factory=time.time)

    def reply(self, kind: str, **kwargs: Any) -> Message:
        """A message answering this one (parent = this id)."""
        return Message(kind, parent=self.id, step=self.step,
                       weight_version=self.weight_version, **kwargs)


# header key -> (attribute, accepted types)
_HEADER_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "v": ("version", (int,)),
    "kind": ("kind", (str,)),
    "id": ("id", (str,)),
    "parent": ("parent", (str, type(None))),
    "src": ("source", (str,)),
    "step": ("step", (int,)),
    "wv": ("weight_version", (int,)),
    "ts": ("timestamp", (float, int)),
    "meta": ("meta", (dict,)),
    "tensors": ("tensors", (list,)),
}


def _tensor_frame(t: torch.Tensor) -> memoryview:
    # reshape(-1) of a contiguous tensor is a view, and view(uint8) reinterprets bytes, so
    # this handles bfloat16/float8 (which numpy lacks) and 0-d tensors without a copy.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for `msg`; tensor frames are zero-copy views of contiguous CPU tensors."""
    descs, frames = [], []
    for i, (name, t) in enumerate(msg.tensors.items(), start=1):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is {type(t).__name__}, not torch.Tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().cpu().contiguous()
        descs.append([name, _DTYPE_NAMES[t.dtype], list(t.shape), i])
        frames.append(_tensor_frame(t))
    header = {
        "v": PROTOCOL_VERSION, "kind": msg.kind, "id": msg.id, "parent": msg.parent,
        "src": msg.source, "step": msg.step, "wv": msg.weight_version,
        "ts": float(msg.timestamp), "meta": msg.meta, "tensors": descs,
    }
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _buffer(frame: Any) -> memoryview:
    buf = frame.buffer if hasattr(frame, "buffer") else frame  # zmq.Frame or bytes-like
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise MalformedHeader(f"frame is not a contiguous buffer: {e}") from None


def _unpack_header(frame: Any) -> dict[str, Any]:
    raw = _buffer(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise MessageTooLarge(f"header is {len(raw)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise MalformedHeader(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise MalformedHeader(f"header is a {type(header).__name__}, expected a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise VersionMismatch(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    for key, (_, types) in _HEADER_TYPES.items():
        if key not in header:
            raise MalformedHeader(f"header lacks field {key!r}")
        value = header[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise MalformedHeader(f"header field {key!r} has type {type(value).__name__}")
    if header["kind"] not in _KINDS:
        raise UnknownKind(f"unknown message kind {header['kind'][:64]!r}")
    return header


TensorSpec = tuple[str, torch.dtype, list[int], int]  # name, dtype, shape, bytes


def _tensor_specs(descs: list[Any], max_bytes: int) -> list[TensorSpec]:
    if len(descs) > MAX_TENSORS:
        raise MessageTooLarge(f"{len(descs)} tensors, limit {MAX_TENSORS}")
    specs, total = [], 0
    for i, d in enumerate(descs, start=1):
        if not (isinstance(d, list) and len(d) == 4 and isinstance(d[0], str)
                and isinstance(d[1], str) and isinstance(d[2], list) and type(d[3]) is int):
            raise MalformedHeader(f"tensor descriptor {i} is not [name, dtype, shape, frame]")
        name, dtype_name, shape, index = d
        if dtype_name not in DTYPES:
            raise UnknownDtype(f"tensor {name!r}: unknown dtype {dtype_name[:32]!r}")
        if len(shape) > MAX_NDIM or not all(type(s) is int and s >= 0 for s in shape):
            raise MalformedHeader(f"tensor {name!r}: shape must be <= {MAX_NDIM} ints >= 0")
        if index != i:
            raise MalformedHeader(f"tensor {name!r}: frame index {index}, expected {i}")
        dtype = DTYPES[dtype_name]
        total += math.prod(shape) * dtype.itemsize
        if total > max_bytes:
            raise MessageTooLarge(f"declared tensor bytes exceed the limit of {max_bytes}")
        specs.append((name, dtype, shape, index))
    if len({s[0] for s in specs}) != len(specs):
        raise MalformedHeader("duplicate tensor names")
    return specs


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Validate `frames` (zmq.Frame or bytes-like) and build a Message, or raise ProtocolError.

    Tensors share memory with the received frames (torch.frombuffer), so no copy is made.
    """
    if len(frames) < 1:
        raise FrameCountMismatch("empty message")
    header = _unpack_header(frames[0])
    specs = _tensor_specs(header["tensors"], max_bytes)
    if len(frames) != 1 + len(specs):
        raise FrameCountMismatch(f"{len(frames)} frames, header declares {1 + len(specs)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, index in specs:
        buf = _buffer(frames[index])
        expected = math.prod(shape) * dtype.itemsize
        if len(buf) != expected:
            raise FrameSizeMismatch(f"tensor {name!r}: frame has {len(buf)} bytes, "
                                    f"shape {shape} {dtype} needs {expected}")
        if expected == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        if buf.readonly:  # bytes input (tests, tools); zmq frames are writable
            buf = memoryview(bytearray(buf))
        tensors[name] = torch.frombuffer(buf, dtype=dtype).view(shape)
    return Message(
        kind=header["kind"], meta=header["meta"], tensors=tensors, id=header["id"],
        parent=header["parent"], source=header["src"], step=header["step"],
        weight_version=header["wv"], timestamp=float(header["ts"]),
    )
