"""A weight-sync group that fails to form: the next epoch starts only once every member's
join has returned. Members join in a thread (a gloo rendezvous that cannot be cut short);
a join cancelled on the coordinator's side still runs on its node until its timeout, so the
next epoch's join queued behind it there, and the members that were free met in the new
epoch without it until theirs timed out too: at 64 twin nodes each regroup failed on another
generator, 120 s each, while the job trained nothing."""

from __future__ import annotations

import asyncio

import pytest

from rlhf_async.pipeline.protocol import WeightSyncConnect, WeightSyncPrepare
from rlhf_async.runtime.messages import Command, decode_reply, to_payload
from rlhf_async.strategies.separation.clients import (
    GeneratorClient,
    PipelineError,
    TrainerClient,
    connect_weight_sync,
)
from rlhf_async.weight_sync import GroupSpec


class Coord:
    """gen0's join fails at once (a peer it dials is gone); gen1's and the trainer's go on
    until `release` is set (their rendezvous' timeout)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.returned: list[str] = []

    async def call(self, node_id: str, cmd: Command, timeout: float = 10.0):
        if isinstance(cmd, WeightSyncPrepare):
            return decode_reply(cmd, to_payload(cmd.spec))
        assert isinstance(cmd, WeightSyncConnect)
        if node_id == "gen0":
            raise RuntimeError("gen0: connection refused")
        await self.release.wait()
        self.returned.append(node_id)
        raise TimeoutError(f"{node_id}: rendezvous timed out")


def test_a_failed_group_returns_once_every_members_join_has():
    async def main() -> None:
        coord = Coord()
        spec = GroupSpec("gloo", "127.0.0.1", 0, 3, timeout_s=5)
        gens = [GeneratorClient(coord, g) for g in ("gen0", "gen1")]  # type: ignore[arg-type]
        attempt = asyncio.ensure_future(
            connect_weight_sync(TrainerClient(coord), gens, spec))  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)
        assert not attempt.done()  # gen0 failed, gen1 and the trainer are still joining
        coord.release.set()
        with pytest.raises(PipelineError, match="gen0: connection refused"):
            await attempt
        assert sorted(coord.returned) == ["gen1", "trainer"]
    asyncio.run(main())
