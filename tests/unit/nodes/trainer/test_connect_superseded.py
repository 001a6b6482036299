"""A node joins only the newest epoch of a weight-sync regroup. A join can run well past
the group's timeout (gloo's connectFullMesh after a peer died in it); the coordinator
meanwhile gives up and asks for epochs 2 and 3. Served in order, the trainer joined epoch
2 (abandoned, alone) before 3, and so on, never in the current one: every regroup of the
64-node twin failed from step 7. Now epoch 2 is refused at once and epoch 3 is joined."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from nodes.trainer.main import Trainer
from rlhf_async.pipeline.protocol import WeightSyncConnect
from rlhf_async.weight_sync import GroupSpec, Joins, WeightSyncSuperseded


class Sender:
    """Its epoch-1 join blocks until released (a rendezvous the node cannot cut short)."""

    def __init__(self) -> None:
        self.joined: list[int] = []
        self.release = threading.Event()

    def connect(self, spec: GroupSpec) -> None:
        if spec.epoch == 1:
            assert self.release.wait(10)
        self.joined.append(spec.epoch)


def test_a_join_of_an_abandoned_epoch_is_refused_and_the_newest_joined() -> None:
    sender = Sender()
    lock = asyncio.Lock()
    me: Any = SimpleNamespace(sender=sender, lock=lock, joins=None)
    # a store address of this test's own: the newest epoch is noted per group and store
    spec = GroupSpec("gloo", "127.0.0.1", 41999, 2, name="superseded-trainer")

    async def run() -> list[Any]:
        me.joins = Joins(lock)
        calls = [asyncio.ensure_future(Trainer._connect(me, WeightSyncConnect(spec.with_epoch(e))))
                 for e in (1, 2, 3)]
        await asyncio.sleep(0.05)  # all three asked while epoch 1 still joins
        sender.release.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    got = asyncio.run(run())
    assert sender.joined == [1, 3]
    assert isinstance(got[1], WeightSyncSuperseded)
    assert "epoch 3" in str(got[1])
    assert [g.group for g in (got[0], got[2])] == ["superseded-trainer@1", "superseded-trainer@3"]


def test_an_older_epoch_asked_after_a_newer_one_is_refused() -> None:
    sender = Sender()
    sender.release.set()
    lock = asyncio.Lock()
    spec = GroupSpec("gloo", "127.0.0.1", 41998, 2, name="superseded-late")

    async def run() -> None:
        me: Any = SimpleNamespace(sender=sender, lock=lock, joins=Joins(lock))
        await Trainer._connect(me, WeightSyncConnect(spec.with_epoch(5)))
        with pytest.raises(WeightSyncSuperseded):
            await Trainer._connect(me, WeightSyncConnect(spec.with_epoch(4)))

    asyncio.run(run())
    assert sender.joined == [5]
