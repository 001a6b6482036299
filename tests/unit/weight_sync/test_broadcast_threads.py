"""A real gloo broadcast between threads of this process (each thread its own group
object): updates, missing receivers, timeouts, which addresses a group listens on, and
ZeRO-3-style group-at-a-time pulls."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
import pytest
import torch
from torch.distributed import PrefixStore

import rlhf_async.weight_sync.group as group_mod
from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    WeightSyncPlanError,
    WeightSyncSuperseded,
    WeightSyncTimeout,
)
from rlhf_async.weight_sync.group import BroadcastGroup, ask_epoch, mesh_timeout_s
from tests.unit.weight_sync.sample import tensors as _tensors


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


def test_a_join_waiting_for_its_peers_leaves_when_a_newer_epoch_is_asked() -> None:
    """The coordinator gave up on epoch 0 (a member is late) and asks for epoch 1: the
    receiver waiting in epoch 0 leaves it then, not at its timeout, so it is free to join
    epoch 1 (it waited out the timeout, and the next epoch queued behind it)."""
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 3, name="left-early", timeout_s=30,
                                    peers=("trainer", "generator g0", "generator g1")))
    rx = TorchBroadcastReceiver("gloo")
    try:
        joining = threading.Thread(target=lambda: out.append(_catch(lambda: rx.connect(spec, 1))))
        out: list[BaseException | None] = []
        joining.start()
        ask_epoch(spec.with_epoch(1))
        joining.join(60)
        assert len(out) == 1 and isinstance(out[0], WeightSyncSuperseded), out
        assert "rank 1 (generator g0) left weight-sync group 'left-early@0'" in str(out[0])
    finally:
        sender.close()
        rx.close()


def _catch(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # the test inspects it
        return exc
    return None


@pytest.mark.parametrize("others", [(0, 2), (0,)])
def test_a_member_of_an_abandoned_epoch_does_not_go_on_into_its_mesh(others) -> None:
    """Rank 2 left the epoch (a newer one was asked of it) while rank 1 waited: rank 1
    reads that and leaves too, naming why, whether or not every rank had joined by then.
    (It went on into gloo's mesh when all had joined, and waited out the mesh's timeout
    there for rank 2's address: a superseded epoch then cost its members that long.)"""
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 3, name="abandoned", timeout_s=20,
                                    peers=("trainer", "generator g0", "generator g1")))
    assert sender._store is not None
    epoch = PrefixStore("weight_sync/abandoned@0/", sender._store)  # as the group's keys
    for r in others:
        epoch.set(f"joined/{r}", "x")
    why = "rank 2 (generator g1) left weight-sync group 'abandoned@0': epoch 1 was asked since"
    epoch.set("outcome", f"abandoned: {why}")
    try:
        with pytest.raises(WeightSyncTimeout, match="was abandoned before rank 1 "
                           r"\(generator g0\) could form it: rank 2 \(generator g1\) left"):
            BroadcastGroup(sender._store, spec, 1, torch.device("cpu"))
    finally:
        sender.close()


def test_a_receiver_reaches_a_restarted_senders_store_on_the_same_port() -> None:
    """The trainer restarted and its new store was given the old one's port: the
    receiver's cached client of the dead store failed every join (a raw 'Broken pipe'),
    for good. Now it opens a new client and joins."""
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, name="restarted", timeout_s=20))
    rx = TorchBroadcastReceiver("gloo")
    again = TorchBroadcastSender("gloo")
    try:
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None, None]
        sender.close()  # the trainer died: its store with it
        later = again.prepare(spec.with_epoch(1))  # the same port, asked for explicitly
        assert later.master_port == spec.master_port
        assert _run_threads([lambda: again.connect(later), lambda: rx.connect(later, 1)]) == [
            None, None]
        tensors = _tensors()
        plan = again.plan(tensors, 1)
        got = _run_threads([lambda: again.send(tensors, plan), lambda: rx.receive(plan)])
        assert all(torch.equal(got[1].tensors[k], t) for k, t in tensors.items())
    finally:
        again.close()
        rx.close()


def test_the_mesh_has_a_shorter_timeout_than_a_transfer(monkeypatch) -> None:
    """gloo's own timeout bounds connecting the mesh (a failed one held every member for
    several times the group's timeout); each broadcast still has the whole timeout: one
    sent later than the mesh's timeout arrives."""
    assert mesh_timeout_s(GroupSpec("gloo", "h", 1, 2, timeout_s=120)) == 30
    assert mesh_timeout_s(GroupSpec("gloo", "h", 1, 2, timeout_s=8)) == 5
    assert mesh_timeout_s(GroupSpec("gloo", "h", 1, 2, timeout_s=1)) == 1
    monkeypatch.setattr(group_mod, "mesh_timeout_s", lambda spec: 3.0)
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 2, name="mesh", timeout_s=60))
    rx = TorchBroadcastReceiver("gloo")
    try:
        assert _run_threads([lambda: sender.connect(spec), lambda: rx.connect(spec, 1)]) == [
            None, None]
        assert rx._group is not None and sender._group is not None
        for group in (rx._group, sender._group):
            assert group._pg.options._timeout.total_seconds() == 3.0
        tensors = _tensors()
        plan = sender.plan(tensors, 1)
        late = threading.Timer(6.0, lambda: sender.send(tensors, plan))  # past the mesh's 3 s
        late.start()
        got = rx.receive(plan)
        late.join()
        assert all(torch.equal(got.tensors[k], t) for k, t in tensors.items())
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
