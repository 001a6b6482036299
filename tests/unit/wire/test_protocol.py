import msgpack
import pytest
import torch

from rlhf_async.wire import protocol as P
from rlhf_async.wire.protocol import Message, decode, encode


def _bytes(frames):
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("dtype", sorted(P.DTYPES, key=str))
def test_roundtrip_every_dtype(dtype):
    torch_dtype = P.DTYPES[dtype]
    src = (torch.arange(24, dtype=torch.float64) - 7).reshape(2, 3, 4)
    t = src.to(torch_dtype) if torch_dtype.is_floating_point or torch_dtype.is_complex \
        else src.abs().to(torch_dtype)
    out = decode(_bytes(encode(Message("rollout", tensors={"x": t}))))
    assert out.tensors["x"].dtype == torch_dtype
    assert out.tensors["x"].shape == (2, 3, 4)
    assert torch.equal(out.tensors["x"].view(torch.uint8), t.view(torch.uint8))


def test_roundtrip_header_fields_and_special_shapes():
    tensors = {
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "strided": torch.arange(20).reshape(4, 5).t(),  # non-contiguous: encoded contiguous
        "ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
    }
    msg = Message("scored_rollout", meta={"rewards": [1.0, -2.5], "tag": "a", "n": None},
                  tensors=tensors, parent="p1", source="scorer0", step=7, weight_version=3)
    out = decode(_bytes(encode(msg)))
    for key in ("kind", "meta", "id", "parent", "source", "step", "weight_version", "timestamp"):
        assert getattr(out, key) == getattr(msg, key), key
    assert out.tensors["empty"].shape == (0, 5)
    assert out.tensors["scalar"].shape == () and out.tensors["scalar"].item() == 3.5
    assert torch.equal(out.tensors["strided"], tensors["strided"])
    assert list(out.tensors) == list(tensors)


def test_encode_is_zero_copy_for_contiguous_cpu_tensors():
    t = torch.zeros(1000)
    frames = encode(Message("rollout", tensors={"t": t}))
    t[0] = 42.0
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)[0] == 42.0


def test_registry_is_extensible():
    assert {"prompts", "rollout", "scored_rollout", "heartbeat"} <= P.known_kinds()
    with pytest.raises(P.UnknownKind):
        decode(encode(Message("zz_custom_kind")))
    P.register_kind("zz_custom_kind")
    assert decode(encode(Message("zz_custom_kind"))).kind == "zz_custom_kind"


def _header(**over):
    h = msgpack.unpackb(encode(Message("rollout"))[0])
    h.update(over)
    return msgpack.packb(h)


def _one_tensor(dtype="float32", shape=(4,), frame=1):
    return _header(tensors=[["x", dtype, list(shape), frame]])


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([], P.FrameCountMismatch),
        ([b"\xc1\xc1garbage"], P.MalformedHeader),
        ([msgpack.packb([1, 2, 3])], P.MalformedHeader),
        ([_header(v=2)], P.VersionMismatch),
        ([_header(v="1")], P.VersionMismatch),
        ([_header(kind="nope")], P.UnknownKind),
        ([_header(step="3")], P.MalformedHeader),
        ([_header(step=True)], P.MalformedHeader),
        ([_header(meta=[1])], P.MalformedHeader),
        ([_header(parent=5)], P.MalformedHeader),
        ([_header(tensors=[["x", "float32", [4]]]), b"0" * 16], P.MalformedHeader),
        ([_one_tensor(dtype="float128"), b"0" * 16], P.UnknownDtype),
        ([_one_tensor(shape=(-1,)), b""], P.MalformedHeader),
        ([_one_tensor(frame=2), b"0" * 16], P.MalformedHeader),
        ([_one_tensor()], P.FrameCountMismatch),
        ([_one_tensor(), b"0" * 16, b"extra"], P.FrameCountMismatch),
        ([_one_tensor(), b"0" * 15], P.FrameSizeMismatch),
        ([_one_tensor(), b"0" * 17], P.FrameSizeMismatch),
        ([_one_tensor(shape=(1 << 40, 1 << 20)), b""], P.MessageTooLarge),
    ],
)
def test_decode_rejects_with_typed_error(frames, error):
    with pytest.raises(error):
        decode(frames)


def test_header_without_required_field_is_malformed():
    h = msgpack.unpackb(encode(Message("rollout"))[0])
    del h["src"]
    with pytest.raises(P.MalformedHeader, match="src"):
        decode([msgpack.packb(h)])


def test_max_bytes_is_checked_before_allocation():
    frames = _bytes(encode(Message("rollout", tensors={"x": torch.zeros(256)})))
    with pytest.raises(P.MessageTooLarge):
        decode(frames, max_bytes=1023)
    assert decode(frames, max_bytes=1024).tensors["x"].numel() == 256


def test_errors_share_a_base_and_carry_a_reason():
    reasons = {cls.reason for cls in P.ProtocolError.__subclasses__()}
    assert len(reasons) == len(P.ProtocolError.__subclasses__())
    assert issubclass(P.FrameSizeMismatch, P.ProtocolError)


def test_encode_rejects_non_tensor_and_bad_meta():
    with pytest.raises(TypeError):
        encode(Message("rollout", tensors={"x": [1, 2]}))
    with pytest.raises(TypeError):
        encode(Message("rollout", meta={"obj": object()}))
