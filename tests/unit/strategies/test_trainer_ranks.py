"""Keeping a multi-rank trainer one group, without processes: a fake coordinator that runs
"processes" as pids, restarts them on request, and answers the group's rendezvous."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, TypeVar

from rlhf_async.pipeline.protocol import TrainGroupConnect, TrainGroupPrepare
from rlhf_async.runtime.messages import Command, decode_reply
from rlhf_async.strategies.separation.clients import ControlPlane, PipelineError
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks

R = TypeVar("R")

RANKS = ["trainer", "trainer1", "trainer2"]


class FakeCoord:
    def __init__(self, restart_limit: int = 5) -> None:
        self._pids = itertools.count(100)
        self.procs = {r: next(self._pids) for r in RANKS}  # node -> pid of its process
        self.restarts = dict.fromkeys(RANKS, 0)
        self.killed: list[tuple[str, int]] = []
        self.connects: list[dict[str, int]] = []  # the pids each rendezvous reached
        self.limit = restart_limit
        self.fail_connects = 0
        self.hosts: dict[str, str] = {}  # node -> where it binds now (after a Ray move)
        self.meets: list[str] = []  # the rendezvous host each rank was told

    def host(self, node: str, default: str) -> str:
        return self.hosts.get(node, default)

    def pid(self, node: str) -> int | None:
        return self.procs.get(node)

    def die(self, node: str) -> int:
        """The process of `node` dies; the coordinator restarts it (a new pid)."""
        old = self.procs[node]
        self.restarts[node] += 1
        self.procs[node] = next(self._pids)
        return old

    def restart(self, node: str, reason: str, pid: int) -> bool:
        if self.procs.get(node) != pid:
            return False
        self.killed.append((node, pid))
        self.die(node)
        return True

    async def wait_ready(self, node_ids: list[str] | None = None,
                         timeout: float | None = None) -> None:
        await asyncio.sleep(0)

    async def moves_followed(self) -> None:
        """Nothing moves here."""

    async def call(self, node_id: str, cmd: Command[R], timeout: float = 10.0) -> R:
        await asyncio.sleep(0)
        request: Command[R] = cmd  # (narrowed below)
        answer: Any
        if isinstance(cmd, TrainGroupPrepare):
            answer = 4242
        else:
            assert isinstance(cmd, TrainGroupConnect)
            if self.fail_connects:
                self.fail_connects -= 1
                raise TimeoutError(f"node {node_id!r} did not answer")
            self.connects.append({node_id: self.procs[node_id]})
            self.meets.append(cmd.addr)
            answer = {"rank": cmd.rank, "world": cmd.world, "pid": self.procs[node_id]}
        return decode_reply(request, answer)


_plane: ControlPlane = FakeCoord()  # mypy: the fake keeps up with the real one


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


def test_a_dead_member_restarts_the_other_ranks_and_a_new_group_forms():
    async def main() -> None:
        coord = FakeCoord()
        ranks = TrainerRanks(coord, RANKS, "127.0.0.1", 5.0)
        ranks.form()
        await settle()
        first = dict(ranks.members)
        assert first == {r: coord.procs[r] for r in RANKS}
        dead = coord.die("trainer1")  # SIGKILLed
        assert sorted(ranks.died("trainer1", dead)) == ["trainer", "trainer2"]
        assert coord.killed == [("trainer", first["trainer"]), ("trainer2", first["trainer2"])]
        await settle()
        assert ranks.members == {r: coord.procs[r] for r in RANKS}
        assert set(ranks.members.values()).isdisjoint(first.values())
        # the deaths of the processes killed with it come later: nothing more to do
        for r in ("trainer", "trainer2"):
            assert ranks.died(r, first[r]) == []
        await settle()
        assert len(coord.killed) == 2 and ranks.failure() is None
    asyncio.run(main())


def test_after_rank_0_moved_host_the_new_group_meets_where_it_runs_now():
    async def main() -> None:
        coord = FakeCoord()
        ranks = TrainerRanks(coord, RANKS, "10.0.0.1", 5.0)  # type: ignore[arg-type]
        ranks.form()
        await settle()
        assert coord.meets == ["10.0.0.1"] * 3
        coord.hosts["trainer"] = "10.0.0.2"  # restarted on another Ray node, re-addressed
        ranks.died("trainer", coord.die("trainer"))
        await settle()
        assert ranks.members == {r: coord.procs[r] for r in RANKS}
        assert coord.meets[3:] == ["10.0.0.2"] * 3
    asyncio.run(main())


def test_a_process_that_was_never_in_a_group_dies_without_taking_others_down():
    async def main() -> None:
        coord = FakeCoord()
        ranks = TrainerRanks(coord, RANKS, "127.0.0.1", 5.0)
        early = coord.die("trainer2")  # killed while loading, before any rendezvous
        ranks.form()
        await settle()
        assert ranks.died("trainer2", early) == [] and coord.killed == []
        assert ranks.members["trainer2"] == coord.procs["trainer2"]
        assert ranks.died("gen0", 7) == []  # not a rank
    asyncio.run(main())


def test_a_failed_rendezvous_restarts_every_rank_and_gives_up_after_three():
    async def main() -> None:
        coord = FakeCoord()
        coord.fail_connects = 1
        ranks = TrainerRanks(coord, RANKS, "127.0.0.1", 5.0)
        ranks.form()
        await settle()
        assert sorted(n for n, _ in coord.killed) == RANKS  # all start afresh
        assert ranks.members == {r: coord.procs[r] for r in RANKS}
        stuck = FakeCoord()
        stuck.fail_connects = 10**6
        never = TrainerRanks(stuck, RANKS, "127.0.0.1", 5.0)  # type: ignore[arg-type]
        never.form()
        await settle()
        error = never.failure()
        assert isinstance(error, PipelineError)
        assert "the trainer ranks did not form a group" in str(error)
    asyncio.run(main())


def test_one_rank_is_no_group():
    async def main() -> None:
        coord = FakeCoord()
        one = TrainerRanks(coord, ["trainer"], "127.0.0.1", 5.0)  # type: ignore[arg-type]
        one.form()
        assert one.task is None and one.died("trainer", coord.procs["trainer"]) == []
    asyncio.run(main())

