"""Weight sync pieces without extra processes: spec, plan, packing, module loading, and a
real gloo broadcast between threads of this process (each thread its own group object)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
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
    WeightSyncTimeout,
    backends,
    load_into_module,
    make_receiver,
    make_sender,
)
from rlhf_async.weight_sync.group import BroadcastGroup
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


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(50, 16, generator=g).to(torch.bfloat16),  # 1600 B
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(3, generator=g).to(torch.float16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "count": torch.tensor([3, 4], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


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


# ---------------------------------------------------------------- real gloo, threads
def _run_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def wrap(i: int) -> None:
        try:
            results[i] = fns[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_threaded_broadcast_two_updates_reuses_buffers() -> None:
    sender = TorchBroadcastSender("gloo", bucket_mb=256 / 2**20)  # 256-byte buckets
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 3, timeout_s=20))
    receivers = [TorchBroadcastReceiver("gloo") for _ in range(2)]
    try:
        out = _run_threads(
            [lambda: sender.connect(spec)]
            + [lambda r=r: receivers[r - 1].connect(spec, r) for r in (1, 2)]
        )
        assert out == [None, None, None]
        for version, seed in ((1, 0), (2, 1)):
            tensors = _tensors(seed)
            plan = msgpack.unpackb(msgpack.packb(sender.plan(tensors, version)))
            got = _run_threads(
                [lambda t=tensors, p=plan: sender.send(t, p)]
                + [lambda rx=rx, p=plan: rx.receive(p) for rx in receivers]
            )
            assert got[0] is None
            for received in got[1:]:
                assert received.version == version
                for name, t in tensors.items():
                    assert torch.equal(received.tensors[name], t), name
        assert sender.buffers_allocated == 1
        assert [rx.buffers_allocated for rx in receivers] == [1, 1]
    finally:
        sender.close()
        for rx in receivers:
            rx.close()


def test_threaded_missing_receiver_names_it() -> None:
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(
        GroupSpec(
            "gloo",
            "127.0.0.1",
            0,
            3,
            timeout_s=1,
            peers=("trainer", "generator g0", "generator g1"),
        )
    )
    rx = TorchBroadcastReceiver("gloo")
    try:
        out = _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)])
        for err in out:
            # On a loaded machine the other thread may also be late; rank 2 is always named.
            assert isinstance(err, WeightSyncTimeout)
            assert "rank 2 (generator g1)" in str(err)
            assert "not join weight-sync group 'actor@0' within 1 s" in str(err)
    finally:
        sender.close()
        rx.close()


def test_transfer_timeout_names_the_step_and_rank() -> None:
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(
        GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=1, peers=("trainer", "generator g0"))
    )
    rx = TorchBroadcastReceiver("gloo")
    try:
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None,
            None,
        ]
        plan = sender.plan(_tensors(), 5)  # shipped, but the trainer never sends
        with pytest.raises(
            WeightSyncTimeout,
            match=r"receive of bucket 1/1 \(v5\) failed on "
            r"rank 1 \(generator g0\) in weight-sync group 'actor@0'",
        ):
            rx.receive(plan)
        with pytest.raises(WeightSyncPlanError, match="plan is for weight-sync group 'actor@9'"):
            rx.receive({**plan, "group": "actor@9"})
    finally:
        sender.close()
        rx.close()


def _listening() -> dict[int, set[str]]:
    """Listening TCP ports of this process -> the addresses each is bound to."""
    out: dict[int, set[str]] = {}
    for c in psutil.Process().net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN:
            out.setdefault(c.laddr.port, set()).add(c.laddr.ip)
    return out


def test_a_single_host_group_listens_on_loopback_only() -> None:
    before = _listening()
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=20))
    rx = TorchBroadcastReceiver("gloo")
    try:
        assert _listening()[spec.master_port] == {"127.0.0.1"}  # the store
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None, None]
        plan = sender.plan(_tensors(), 1)
        got = _run_threads([lambda: sender.send(_tensors(), plan), lambda: rx.receive(plan)])
        assert got[0] is None and got[1].version == 1
        opened = {p: ips for p, ips in _listening().items() if p not in before}
        assert spec.master_port in opened and len(opened) >= 2  # the store and gloo's pairs
        assert set().union(*opened.values()) == {"127.0.0.1"}, opened
    finally:
        sender.close()
        rx.close()
    wide = TorchBroadcastSender("gloo")  # a host name: receivers on other hosts reach it
    try:
        port = wide.prepare(GroupSpec("gloo", socket.gethostname(), 0, 2)).master_port
        assert _listening()[port] & {"::", "0.0.0.0"}
    finally:
        wide.close()


def test_a_sender_on_another_loopback_address_is_reached_there() -> None:
    """A host of its own to Ray on one machine (127.0.0.3, a trainer moved there): the
    store listens on that address, not on 127.0.0.1, and the receivers reach it."""
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.3", 0, 2, timeout_s=20))
    rx = TorchBroadcastReceiver("gloo")
    try:
        assert _listening()[spec.master_port] == {"127.0.0.3"}
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None, None]
        plan = sender.plan(_tensors(), 1)
        got = _run_threads([lambda: sender.send(_tensors(), plan), lambda: rx.receive(plan)])
        assert got[0] is None and got[1].version == 1
    finally:
        sender.close()
        rx.close()


CUTS = [  # consecutive groups of _tensors(): a bucket then spans groups, or lies in one
    [["emb"], ["w", "h"], ["scalar", "empty", "count", "mask"]],
    [["emb", "w"], ["h"], ["scalar"], ["empty"], ["count", "mask"]],
    [["emb", "w", "h", "scalar", "empty", "count", "mask"]],
]


def _pulled(cut: list[list[str]], tensors: dict[str, torch.Tensor], offsets: dict[str, int],
            sent: list[int], behind: list[tuple[int, int]]) -> Iterator[dict[str, torch.Tensor]]:
    """The groups of `cut`; on each request, notes the bytes sent and the bytes (of whole
    256-byte buckets) that lie before the group."""
    for names in cut:
        behind.append((sent[0], offsets[names[0]] // 256 * 256))
        yield {n: tensors[n] for n in names}


def test_threaded_broadcast_of_groups_is_pulled_a_group_at_a_time(monkeypatch) -> None:
    """A sharded trainer hands the send one gathered group at a time: each must be sent
    (every bucket it completes) before the next is asked for, and the bytes must arrive
    exactly as from one mapping; the plan needs only meta tensors."""
    sent = [0]  # bytes broadcast by rank 0 so far
    real = BroadcastGroup.broadcast

    def counting(self: BroadcastGroup, buf: torch.Tensor) -> torch.distributed.Work:
        sent[0] += buf.numel() if self.rank == 0 else 0
        return real(self, buf)

    monkeypatch.setattr(BroadcastGroup, "broadcast", counting)
    sender = TorchBroadcastSender("gloo", bucket_mb=256 / 2**20)  # 256-byte buckets
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, timeout_s=20))
    rx = TorchBroadcastReceiver("gloo")
    try:
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None, None]
        for version, cut in enumerate(CUTS):
            tensors = _tensors(version)
            meta = {k: v.to("meta") for k, v in tensors.items()}
            plan = sender.plan(meta, version)
            assert plan == sender.plan(tensors, version)
            offsets = {t["name"]: t["offset"] for t in plan["tensors"]}
            behind: list[tuple[int, int]] = []  # (bytes sent, bytes wholly before the group)
            groups = _pulled(cut, tensors, offsets, sent, behind)
            sent[0] = 0
            got = _run_threads([lambda p=plan, g=groups: sender.send(g, p),
                                lambda p=plan: rx.receive(p)])
            assert got[0] is None and got[1].version == version
            for name, t in tensors.items():
                assert torch.equal(got[1].tensors[name], t), name
            assert all(done >= due for done, due in behind), behind
            assert sent[0] == plan["total_bytes"]
            assert sender.largest_group_bytes == max(
                sum(tensors[n].numel() * tensors[n].element_size() for n in names)
                for names in cut)
        plan = sender.plan(_tensors(), 9)
        with pytest.raises(WeightSyncPlanError, match="names or their order differ"):
            sender.send(iter([{"w": _tensors()["w"]}]), plan)  # checked before any transfer
    finally:
        sender.close()
        rx.close()
