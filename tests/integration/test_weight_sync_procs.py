"""Weight broadcast between real OS processes (spawned), the way trainer and generators run.

The multiprocessing queues stand in for the ZeroMQ control plane: they carry the group spec
and the per-update plan dicts, never tensors.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    WeightSyncError,
    WeightSyncTimeout,
    weights_of,
)

BUCKET_MB = 4096 / 2**20  # 4 KiB buckets: the embedding below spans several
PEERS = ("trainer", "generator g0", "generator g1")
WAIT_S = 60


class Tiny(torch.nn.Module):
    """Mixed dtypes, a buffer, and one tensor (the embedding) larger than a bucket."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(100, 32).to(torch.bfloat16)  # 6400 B > 4096 B bucket
        self.proj = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 8).to(torch.float16)
        self.register_buffer("seen", torch.tensor([seed], dtype=torch.int64))


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _receiver_main(spec: dict[str, Any], rank: int, cmds: Any, out: Any) -> None:
    torch.set_num_threads(1)
    # The generator's own default group (tensor parallelism, say) must not interfere.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = Tiny(seed=100 + rank)  # deliberately different from the trainer's weights
    rx = TorchBroadcastReceiver("gloo")
    try:
        rx.connect(GroupSpec.from_dict(spec), rank)
        out.put(("connected", rank))
        while True:
            kind, payload = cmds.get(timeout=WAIT_S)
            if kind == "plan":
                version = rx.receive(payload).load_into(model)
                dist.all_reduce(torch.ones(1))  # the default group still works beside ours
                out.put(("applied", rank, version, _digest(model), rx.buffers_allocated))
            elif kind == "connect":
                rx.connect(GroupSpec.from_dict(payload), rank)
                out.put(("connected", rank))
            else:
                break
    except WeightSyncError as exc:
        out.put(("error", rank, type(exc).__name__, str(exc)))
    finally:
        rx.close()
        dist.destroy_process_group()


class Generators:
    """Receiver processes, each with its own command and result queue: a process killed
    while its queue's feeder thread holds the lock would wedge a queue it shared."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.cmds: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}

    def start(self, spec: GroupSpec, rank: int) -> None:
        self.cmds[rank], self.outs[rank] = self.ctx.Queue(), self.ctx.Queue()
        p = self.ctx.Process(
            target=_receiver_main,
            args=(spec.to_dict(), rank, self.cmds[rank], self.outs[rank]),
            daemon=True,
        )
        p.start()
        self.procs[rank] = p

    def tell(self, kind: str, payload: Any, ranks: list[int] | None = None) -> None:
        for r in ranks or list(self.cmds):
            self.cmds[r].put((kind, payload))

    def collect(self, ranks: tuple[int, ...] = (1, 2)) -> list[tuple[Any, ...]]:
        return [self.outs[r].get(timeout=WAIT_S) for r in ranks]

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join(WAIT_S)

    def stop(self) -> None:
        self.tell("stop", None)
        for p in self.procs.values():
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()


@pytest.fixture
def gens() -> Any:
    g = Generators()
    yield g
    g.stop()


def _trainer() -> tuple[TorchBroadcastSender, GroupSpec, Tiny]:
    sender = TorchBroadcastSender("gloo", bucket_mb=BUCKET_MB)
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 3, timeout_s=30, peers=PEERS))
    return sender, spec, Tiny(seed=0)


def _publish(sender: TorchBroadcastSender, model: Tiny, version: int, gens: Generators) -> None:
    with torch.no_grad():  # stands in for an optimizer step
        for p in model.parameters():
            p.add_(0.5)
    weights = weights_of(model)
    plan = sender.plan(weights, version)
    gens.tell("plan", plan)  # over ZeroMQ in the real system
    sender.send(weights, plan)


def test_two_receivers_mixed_dtypes_second_update_reuses_buffers(gens: Generators) -> None:
    torch.set_num_threads(1)
    sender, spec, model = _trainer()
    try:
        for rank in (1, 2):  # the remote side starts joining first
            gens.start(spec, rank)
        sender.connect(spec)
        assert gens.collect() == [("connected", 1), ("connected", 2)]
        for version in (1, 2):
            _publish(sender, model, version, gens)
            want = _digest(model)
            assert gens.collect() == [("applied", r, version, want, 1) for r in (1, 2)]
        assert sender.buffers_allocated == 1
    finally:
        sender.close()


def test_rejoin_with_new_epoch_after_replacing_a_receiver(gens: Generators) -> None:
    torch.set_num_threads(1)
    sender, spec, model = _trainer()
    try:
        for rank in (1, 2):
            gens.start(spec, rank)
        sender.connect(spec)
        gens.collect()
        _publish(sender, model, 1, gens)
        gens.collect()

        gens.kill(2)  # generator g1 dies; the coordinator restarts it in a new epoch
        new_spec = spec.with_epoch(1)
        gens.tell("connect", new_spec.to_dict(), ranks=[1])
        gens.start(new_spec, 2)
        sender.connect(new_spec)
        assert gens.collect() == [("connected", 1), ("connected", 2)]

        _publish(sender, model, 2, gens)
        want = _digest(model)
        results = gens.collect()
        assert [r[:4] for r in results] == [("applied", r, 2, want) for r in (1, 2)]
    finally:
        sender.close()


def test_missing_peer_times_out_naming_it(gens: Generators) -> None:
    torch.set_num_threads(1)
    sender = TorchBroadcastSender("gloo")
    spec = sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, 3, timeout_s=2, peers=PEERS))
    try:
        gens.start(spec, 1)  # generator g1 (rank 2) never comes
        _wait_joined(spec, 1)  # so that only rank 2 is missing, however slow the spawn is
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout) as info:
            sender.connect(spec)
        elapsed = time.monotonic() - start
        want = "rank 2 (generator g1) did not join weight-sync group 'actor@0' within 2 s"
        assert want in str(info.value)
        assert elapsed < 30  # bounded by the timeout, with room for a loaded machine
        ((kind, rank, cls, msg),) = gens.collect((1,))
        assert (kind, rank, cls) == ("error", 1, "WeightSyncTimeout")
        assert "rank 2 (generator g1)" in msg and "not join weight-sync group 'actor@0'" in msg
    finally:
        sender.close()


def test_receiver_without_trainer_names_the_trainer() -> None:
    spec = GroupSpec("gloo", "127.0.0.1", _free_port(), 2, timeout_s=1, peers=PEERS[:2])
    rx = TorchBroadcastReceiver("gloo")
    with pytest.raises(
        WeightSyncTimeout,
        match=r"could not reach the weight-sync store of "
        r"rank 0 \(trainer\)",
    ):
        rx.connect(spec, 1)


def _wait_joined(spec: GroupSpec, rank: int) -> None:
    store = TCPStore(spec.master_addr, spec.master_port, None, False, timedelta(seconds=WAIT_S))
    joined = PrefixStore(f"weight_sync/{spec.group_name}/", store)
    deadline = time.monotonic() + WAIT_S
    while not joined.check([f"joined/{rank}"]):
        assert time.monotonic() < deadline, f"rank {rank} never started joining"
        time.sleep(0.02)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
