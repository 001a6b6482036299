"""The protobuf messages of the Tinker API, read and written at the wire level.

The client SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and reads
`ForwardBackwardOutput` and `SampleResponse` only as protobuf (when it sends `Accept:
application/x-protobuf`). Those three messages are all the server needs, so instead of
depending on the SDK's generated module this reads and writes the wire format itself
(varints, length-delimited fields, fixed64), with the field numbers of the SDK 0.38.0
schema (`tinker/proto/tinker_public_pb2.pyi`; read there, not copied).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CONTENT_TYPE = "application/x-protobuf"
# the schema's DType enum -> numpy
DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype(np.float32), 2: np.dtype(np.int64),
                                   3: np.dtype(np.int32)}
BFLOAT16 = 4
STOP, LENGTH = 0, 1  # StopReason


class ProtoError(ValueError):
    """A message that does not parse as the schema says."""


# ---- the wire format -------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ProtoError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs: a varint as int, a length-delimited or fixed field as
    its bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ProtoError(f"field {number}: {n} bytes announced, {len(buf) - i} left")
            yield number, buf[i:i + n]
            i += n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if i + n > len(buf):
                raise ProtoError(f"field {number}: truncated fixed field")
            yield number, buf[i:i + n]
            i += n
        else:
            raise ProtoError(f"field {number}: unsupported wire type {wire}")


def _enc_varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 as two's complement, as protobuf does
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def enc_bytes(number: int, data: bytes) -> bytes:
    return _enc_varint(number << 3 | 2) + _enc_varint(len(data)) + data


def enc_int(number: int, value: int) -> bytes:
    return _enc_varint(number << 3) + _enc_varint(value) if value else b""


def enc_double(number: int, value: float) -> bytes:
    return _enc_varint(number << 3 | 1) + struct.pack("<d", value)


def _ints(value: int | bytes) -> list[int]:
    """A repeated integer field's entry: one varint, or a packed run of them."""
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


def _as_bytes(value: int | bytes, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise ProtoError(f"{what}: expected bytes, got a varint")
    return value


def _as_int(value: int | bytes, what: str) -> int:
    if not isinstance(value, int):
        raise ProtoError(f"{what}: expected a varint, got bytes")
    return value


def _as_double(value: int | bytes, what: str) -> float:
    if not isinstance(value, bytes) or len(value) != 8:
        raise ProtoError(f"{what}: expected a double")
    return float(struct.unpack("<d", value)[0])


# ---- ForwardBackwardRequest -----------------------------------------------------------
@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)
    problem: str = ""  # a datum that does not parse: the request fails in its turn


def _tensor(buf: bytes, name: str) -> np.ndarray:
    dense, csr, dtype, shape = None, None, 0, []
    for n, v in fields(buf):
        if n == 1:
            dense = _as_bytes(v, name)
        elif n == 2:
            csr = {k: _as_bytes(x, name) for k, x in fields(_as_bytes(v, name))}
        elif n == 3:
            dtype = _as_int(v, name)
        elif n == 4:
            shape += _ints(v)
    if dtype == BFLOAT16:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: bfloat16 is not a public input dtype")
    np_dtype = DTYPES.get(dtype)
    if np_dtype is None:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: unknown dtype {dtype}")
    if csr is not None:
        values = np.frombuffer(csr.get(1, b""), dtype=np_dtype)
        crow = np.frombuffer(csr.get(2, b""), dtype=np.int64)
        col = np.frombuffer(csr.get(3, b""), dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or \
                (len(col) and (col.min() < 0 or col.max() >= shape[1])) or \
                (len(crow) and crow[-1] != len(values)):
            raise ProtoError(f"loss_fn_inputs[{name!r}]: inconsistent sparse CSR tensor")
        out = np.zeros(shape, dtype=np_dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    arr = np.frombuffer(dense or b"", dtype=np_dtype)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise ProtoError(f"loss_fn_inputs[{name!r}]: shape {shape} but {arr.size} values")
        arr = arr.reshape(shape)
    return arr


def _datum(buf: bytes, index: int) -> Datum:
    datum = Datum([])
    for n, v in fields(buf):
        if n == 1:  # a Chunk: only encoded text carries tokens here
            for kind, chunk in fields(_as_bytes(v, "chunk")):
                if kind != 1:
                    raise ProtoError("image and audio chunks are not served "
                                     "(token chunks only)")
                for k, toks in fields(_as_bytes(chunk, "chunk")):
                    if k == 1:
                        datum.tokens += np.frombuffer(_as_bytes(toks, "tokens"),
                                                      dtype=np.int32).tolist()
        elif n == 2:  # map entry: key 1, Tensor 2
            entry = dict(fields(_as_bytes(v, "loss_fn_inputs")))
            name = _as_bytes(entry.get(1, b""), "key").decode()
            datum.inputs[name] = _tensor(_as_bytes(entry.get(2, b""), name), name)
    return datum


def parse_forward_backward(buf: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    legacy: dict[str, float | str] = {}
    for n, v in fields(buf):
        if n == 1:
            req.model_id = _as_bytes(v, "model_id").decode()
        elif n == 2:
            req.seq_id = _as_int(v, "seq_id")
        elif n == 3:
            try:
                req.data.append(_datum(_as_bytes(v, "data"), len(req.data)))
            except ValueError as e:  # ProtoError, or bytes numpy cannot view as the dtype
                req.problem = req.problem or f"datum {len(req.data)}: {e}"
                req.data.append(Datum([]))
        elif n == 4:
            req.loss_fn = _as_bytes(v, "loss_fn").decode()
        elif n == 5:  # legacy float map
            entry = dict(fields(_as_bytes(v, "loss_fn_config")))
            legacy[_as_bytes(entry.get(1, b""), "key").decode()] = \
                _as_double(entry.get(2, struct.pack("<d", 0.0)), "loss_fn_config")
        elif n == 6:
            req.forward_only = bool(_as_int(v, "forward_only"))
        elif n == 7:  # v2 map: key -> LossConfigValue{number 1, text 2}
            entry = dict(fields(_as_bytes(v, "loss_fn_config_v2")))
            key = _as_bytes(entry.get(1, b""), "key").decode()
            value = dict(fields(_as_bytes(entry.get(2, b""), key)))
            req.loss_fn_config[key] = _as_bytes(value[2], key).decode() if 2 in value \
                else _as_double(value.get(1, struct.pack("<d", 0.0)), key)
    req.loss_fn_config = {**legacy, **req.loss_fn_config}  # v2 wins where both are set
    return req


# ---- responses -------------------------------------------------------------------------
def _batched(arrays: list[np.ndarray]) -> bytes:
    """BatchedTensor of 1-d float32 arrays: data, byte offsets (int64), dtype, no trailing
    shape."""
    flat = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    offsets = np.cumsum([0, *(a.nbytes for a in flat)], dtype=np.int64)
    return (enc_bytes(1, b"".join(a.tobytes() for a in flat)) + enc_bytes(2, offsets.tobytes())
            + enc_int(3, 1))


def forward_backward_output(outputs: list[dict[str, np.ndarray]],
                            metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord holding each output field for every datum."""
    names = sorted(outputs[0]) if outputs else []
    record = enc_bytes(1, b"ArrayRecord") + enc_int(3, len(outputs)) + b"".join(
        enc_bytes(2, enc_bytes(1, name.encode()) + enc_bytes(2, _batched(
            [o[name] for o in outputs]))) for name in names)
    out = enc_bytes(1, b"ArrayRecord") + enc_bytes(2, record)
    for key, value in metrics.items():
        out += enc_bytes(3, enc_bytes(1, key.encode()) + enc_double(2, float(value)))
    return out


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # ended at EOS / a stop (else at max_tokens)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    out = b""
    for s in sequences:
        seq = (enc_int(1, STOP if s.stopped else LENGTH)
               + enc_bytes(2, np.asarray(s.tokens, dtype=np.int32).tobytes())
               + enc_bytes(3, np.asarray(s.logprobs, dtype=np.float32).tobytes()))
        out += enc_bytes(1, seq)
    if prompt_logprobs is not None:
        out += enc_bytes(2, np.asarray(prompt_logprobs, dtype=np.float32).tobytes())
    return out
