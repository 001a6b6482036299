"""Weight sync pieces without extra processes: spec, plan, packing, module loading (the
gloo broadcast between threads: test_broadcast_threads.py)."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    WeightSyncError,
    WeightSyncPlanError,
    backends,
    load_into_module,
    make_receiver,
    make_sender,
)
from rlhf_async.weight_sync.plan import (
    ALIGN,
    as_bytes,
    build_layout,
    pack_bucket,
    parse_plan,
    pieces_per_bucket,
    plan_dict,
    views,
)
from tests.unit.weight_sync.sample import tensors as _tensors


# ---------------------------------------------------------------- spec
def test_spec_roundtrip_and_names() -> None:
    spec = GroupSpec("gloo", "127.0.0.1", 1234, 3, epoch=2, peers=("trainer", "g0", "g1"))
    assert GroupSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict()))) == spec
    assert spec.group_name == "actor@2"
    assert spec.describe(2) == "rank 2 (g1)"
    assert spec.with_epoch(3).group_name == "actor@3"


def test_spec_lists_every_problem() -> None:
    bad = {
        "backend": "mpi",
        "master_addr": "",
        "master_port": 70000,
        "world_size": 1,
        "epoch": -1,
        "timeout_s": 0,
    }
    with pytest.raises(WeightSyncPlanError) as info:
        GroupSpec.from_dict(bad)
    msg = str(info.value)
    for word in ("backend 'mpi'", "master_addr", "master_port", "world_size", "epoch", "timeout_s"):
        assert word in msg
    with pytest.raises(WeightSyncPlanError, match="unknown key 'colour'.*missing key 'world_size'"):
        GroupSpec.from_dict({"backend": "gloo", "master_addr": "h", "master_port": 1, "colour": 1})
    with pytest.raises(WeightSyncPlanError, match="peers has 2 names for world_size 3"):
        GroupSpec("gloo", "h", 1, 3, peers=("a", "b"))


# ---------------------------------------------------------------- plan
@pytest.mark.parametrize("bucket_bytes", [ALIGN, 256, 1024, 1 << 20])
def test_pack_then_view_recovers_every_tensor(bucket_bytes: int) -> None:
    tensors = _tensors()
    layout = build_layout(tensors, bucket_bytes)
    pieces = pieces_per_bucket(layout)
    covered = sum(hi - lo for bucket in pieces for _, lo, hi, _ in bucket)
    assert covered == sum(s.nbytes for s in layout.slots)  # every byte once
    sources = [as_bytes(tensors[s.name]) for s in layout.slots]
    stream = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for (lo, size), bucket in zip(layout.buckets, pieces, strict=True):
        assert size <= bucket_bytes
        pack_bucket(stream[lo : lo + size], bucket, sources)
    got = views(stream, layout)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


_DTYPE_CHOICES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.lists(st.integers(0, 40), max_size=3), st.sampled_from(_DTYPE_CHOICES)),
        min_size=1,
        max_size=8,
    ),
    buckets_of_64=st.integers(1, 40),
)
def test_any_layout_packs_and_views_losslessly(
    shapes: list[tuple[list[int], torch.dtype]], buckets_of_64: int
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": (torch.rand(shape, generator=g) * 100).to(dtype)
        for i, (shape, dtype) in enumerate(shapes)
    }
    layout = build_layout(tensors, buckets_of_64 * ALIGN)
    sources = [as_bytes(tensors[s.name]) for s in layout.slots]
    stream = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for (lo, size), pieces in zip(layout.buckets, pieces_per_bucket(layout), strict=True):
        pack_bucket(stream[lo : lo + size], pieces, sources)
    got = views(stream, layout)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_big_tensor_is_split_across_buckets() -> None:
    layout = build_layout({"big": torch.zeros(1000)}, 1024)  # 4000 B over 1 KiB buckets
    assert layout.total_bytes == 4032  # 4000 rounded up to the 64-byte alignment
    assert [size for _, size in layout.buckets] == [1024, 1024, 1024, 960]
    assert all(len(p) == 1 for p in pieces_per_bucket(layout))


def test_plan_is_msgpack_roundtrip_and_validated() -> None:
    layout = build_layout(_tensors(), 256)
    plan = msgpack.unpackb(msgpack.packb(plan_dict(layout, 7, "actor@0")))
    version, group, parsed = parse_plan(plan)
    assert (version, group, parsed.signature) == (7, "actor@0", layout.signature)
    broken = [
        {**plan, "format": 2},
        {**plan, "tensors": [{**plan["tensors"][0], "dtype": "complex64"}, *plan["tensors"][1:]]},
        {**plan, "total_bytes": plan["total_bytes"] + 64},
        {**plan, "tensors": [{**plan["tensors"][1], "offset": 0}, *plan["tensors"][1:]]},
        {k: v for k, v in plan.items() if k != "buckets"},
        {**plan, "version": "x"},
    ]
    for bad in broken:
        with pytest.raises(WeightSyncPlanError, match="malformed weight-sync plan"):
            parse_plan(bad)


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(WeightSyncPlanError, match="z: torch.complex64"):
        build_layout({"z": torch.zeros(2, dtype=torch.complex64)}, 1024)


# ---------------------------------------------------------------- module loading
def _mixed_model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    m[1].to(torch.bfloat16)
    m.register_buffer("steps", torch.tensor([0]))
    return m


def test_load_into_module_all_or_nothing() -> None:
    src, dst = _mixed_model(), _mixed_model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    bad = dict(src.state_dict())
    bad["0.weight"] = torch.zeros(3, 5)
    bad["extra"] = torch.zeros(1)
    del bad["1.bias"]
    with pytest.raises(WeightSyncPlanError) as info:
        load_into_module(dst, bad)
    msg = str(info.value)
    assert "unexpected tensor 'extra'" in msg and "missing tensor '1.bias'" in msg
    assert "0.weight: shape [3, 5] does not fit model's [3, 4]" in msg
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k]), "model changed despite the error"
    load_into_module(dst, src.state_dict())
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k])


# ---------------------------------------------------------------- registry & construction
def test_registry() -> None:
    assert backends() == ["gloo", "nccl"]
    assert isinstance(make_sender("gloo", bucket_mb=1), TorchBroadcastSender)
    assert isinstance(make_receiver("gloo"), TorchBroadcastReceiver)
    with pytest.raises(WeightSyncPlanError, match="unknown weight-sync backend 'mpi'.*gloo, nccl"):
        make_sender("mpi")
    with pytest.raises(WeightSyncError, match="needs a CUDA device"):
        TorchBroadcastSender("nccl", device="cpu")
    with pytest.raises(WeightSyncError, match="not connected"):
        TorchBroadcastSender("gloo").plan(_tensors(), 1)
