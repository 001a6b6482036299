"""The Separation Driver as a state machine, without processes: a fake coordinator records
commands, a queue stands in for the event stream, a list for the prompts channel."""

from __future__ import annotations

import asyncio
import errno
import json
from collections import Counter
from typing import Any, TypeVar

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.client import NodeEvent
from rlhf_async.metrics import MetricsWriter
from rlhf_async.pipeline.protocol import (
    ChunkDropped,
    Done,
    Failed,
    Generated,
    Loaded,
    NodeDead,
    Published,
    Received,
    Scored,
    Trained,
    UpdateWeights,
    WeightsApplied,
    WeightSync,
    WeightSyncPrepare,
)
from rlhf_async.rl.checkpoint import DiskFullError
from rlhf_async.runtime.messages import Command, Msg, decode_reply, tag, to_payload
from rlhf_async.strategies.separation.clients import ControlPlane
from rlhf_async.strategies.separation.driver import ChunkState, Driver, PipelineError
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.protocol import Message

R = TypeVar("R")

ROLES = {"trainer": "trainer", "gen0": "generator", "gen1": "generator", "scorer0": "scorer"}
LINEAGE = "abcd"


class FakeCoord:
    """A `ControlPlane`: records each command and answers it as a node would, on the wire
    (the reply is decoded as the real coordinator decodes it)."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, Command[Any]]] = []

    async def call(self, node_id: str, cmd: Command[R], timeout: float = 10.0) -> R:
        self.commands.append((node_id, cmd))
        answer: Any = {}
        if isinstance(cmd, WeightSyncPrepare):
            answer = to_payload(cmd.spec)
        elif isinstance(cmd, UpdateWeights):
            answer = {"version": cmd.plan["version"]}
        elif tag(cmd) == "republish":
            answer = {"version": None}
        elif tag(cmd) == "weight_sync_connect":
            answer = {"group": "actor@1"}
        return decode_reply(cmd, answer)

    async def wait_ready(self, node_ids: list[str] | None = None,
                         timeout: float | None = None) -> None:
        """Every node is ready here."""

    async def moves_followed(self) -> None:
        """No node moved host here (the Ray launcher's moves: test_ray.py)."""

    def host(self, node_id: str, default: str) -> str:
        return default

    def pid(self, node_id: str) -> int | None:
        return 100

    def restart(self, node_id: str, reason: str, pid: int) -> bool:
        return False


_plane: ControlPlane = FakeCoord()  # mypy: the fake keeps up with the real one


class Events:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[NodeEvent] = asyncio.Queue()

    async def get(self, timeout: float | None = None) -> NodeEvent:
        return await asyncio.wait_for(self.queue.get(), timeout)

    def put(self, node: str, event: Msg) -> None:
        self.queue.put_nowait(NodeEvent(node, tag(event), to_payload(event)))


class Prompts:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (step, chunk) of each prompts message

    async def send(self, msg: Message, timeout: float | None = None) -> None:
        self.sent.append((msg.meta["step"], msg.meta["chunk"]))


class Harness:
    def __init__(self, tmp_path, staleness: int = 0, steps: int = 3,
                 backlog: list[NodeEvent] | None = None) -> None:
        cfg = load_config(None, [f"train.steps={steps}", "train.prompts_per_step=4",
                                 f"algo.max_staleness={staleness}", "run.progress=false",
                                 "runtime.restart_limit=2"])
        self.coord, self.events, self.prompts = FakeCoord(), Events(), Prompts()
        spec = GroupSpec("gloo", "127.0.0.1", 0, 3, timeout_s=5)
        ranks = TrainerRanks(self.coord, ["trainer"], "127.0.0.1", 5.0)
        self.driver = Driver(cfg, self.coord, self.events, self.prompts, dict(ROLES),
                             spec, tmp_path, 2, 0, LINEAGE, ranks, backlog)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.driver.run())
        await settle()

    async def send(self, node: str, event: Msg) -> None:
        self.events.put(node, event)
        await settle()

    async def trained(self, step: int, version: int = 0) -> None:
        ids = list(range(step * 4, step * 4 + 4))
        await self.send("trainer", Trained(
            step=step, metrics={"samples": 4.0, "loss": 0.5}, sample_ids=ids,
            rollout_version=version, queue_trainer=0, weight_sync=WeightSync(), busy_s=1.0,
            idle_s=0.0))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_dispatch_waits_for_every_generator_to_apply_the_next_version(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path)
        await h.start()
        assert h.prompts.sent == [(0, 0), (0, 1)]  # step 0: two chunks, then the gate
        await h.trained(0)
        await h.send("trainer", Published({"version": 1}, LINEAGE))
        forwarded = [(n, tag(c)) for n, c in h.coord.commands if isinstance(c, UpdateWeights)]
        assert sorted(forwarded) == [("gen0", "update_weights"), ("gen1", "update_weights")]
        await h.send("gen0", WeightsApplied(1, LINEAGE))
        assert len(h.prompts.sent) == 2  # gen1 still holds version 0
        await h.send("gen1", WeightsApplied(1, LINEAGE))
        assert h.prompts.sent[2:] == [(1, 0), (1, 1)]
        await h.send("gen0", WeightsApplied(2, "someone-else"))  # a dead trainer's weights
        await h.trained(1, 1)
        await h.send("gen1", WeightsApplied(2, LINEAGE))
        assert len(h.prompts.sent) == 4  # gen0 holds weights of another lineage
        await h.send("trainer", Done("/p", 3))
        assert (await h.task) == {"policy_dir": "/p", "steps": 3}  # type: ignore[misc]
    asyncio.run(main())


def test_staleness_lets_generation_run_one_version_ahead(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path, staleness=1)
        await h.start()
        assert [s for s, _ in h.prompts.sent] == [0, 0, 1, 1]  # step 1 on version 0
        await h.trained(0)
        assert len(h.prompts.sent) == 4  # step 2 needs version 1 applied
        for gen in ("gen0", "gen1"):
            await h.send(gen, WeightsApplied(1, LINEAGE))
        assert [s for s, _ in h.prompts.sent[4:]] == [2, 2]
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_a_dead_nodes_chunks_are_sent_again_by_state(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path)
        await h.start()
        await h.send("gen0", Generated(0, 0, 2, 0, 1.0, 0.0))
        assert h.driver.chunk_state == {(0, 0): ChunkState.GENERATED,
                                        (0, 1): ChunkState.DISPATCHED}
        # the payload exactly as the coordinator publishes it
        h.events.queue.put_nowait(NodeEvent("gen0", "node_dead", {
            "reason": "heartbeats stopped", "exit_code": None, "will_restart": True}))
        await settle()
        assert "gen0" in h.driver.down and h.driver.generators == ["gen1"]
        await h.send("gen0", Loaded())
        # what was in a generator's queue, and what it generated: the rollout may still
        # have been in its socket's queue when it died
        assert sorted(h.prompts.sent[2:]) == [(0, 0), (0, 1)]
        # scored, but its rollout may still sit in the killed scorer's socket: sent again
        await h.send("scorer0", Scored(0, 0, 2, 1.0, 0.0))
        await h.send("gen1", Generated(0, 0, 2, 0, 1.0, 0.0))  # late news: no step back
        assert h.driver.chunk_state[(0, 0)] == ChunkState.GENERATED
        await h.send("scorer0", NodeDead("killed", will_restart=True))
        await h.send("scorer0", Loaded())
        assert sorted(h.prompts.sent[4:]) == [(0, 0), (0, 1)]
        # once the trainer holds it, no death of another node sends it again
        await h.send("trainer", Received(0, 0, 2))
        await h.send("gen1", Generated(0, 0, 2, 0, 1.0, 0.0))
        assert h.driver.chunk_state[(0, 0)] == ChunkState.SCORED
        await h.send("scorer0", NodeDead("killed", will_restart=True))
        await h.send("scorer0", Loaded())
        assert h.prompts.sent[6:] == [(0, 1)]
        assert h.driver.counts["restarts"] == 3 and h.driver.counts["resent_chunks"] == 5
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_a_trained_step_is_forgotten_and_a_dropped_chunk_resent(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path)
        await h.start()
        await h.send("trainer", ChunkDropped(0, 1, 2, 0))  # stale: the trainer refused it
        assert h.prompts.sent == [(0, 0), (0, 1), (0, 1)]
        await h.trained(0)
        assert h.driver.chunk_state == {} and h.driver.chunk_prompts == {}
        await h.send("gen1", Generated(0, 1, 2, 0, 1.0, 0.0))  # late news of a trained step
        await h.send("trainer", ChunkDropped(0, 1, 2, 0))  # a duplicate the trainer dropped
        await h.send("scorer0", NodeDead("killed", will_restart=True))
        await h.send("scorer0", Loaded())
        assert h.driver.chunk_state == {} and len(h.prompts.sent) == 3
        assert h.driver.trained_ids == Counter(range(4))  # each sample once
        record = (tmp_path / "metrics.jsonl").read_text()
        assert '"step": 0' in record and '"queue/dispatched": 0' in record
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_a_retired_nodes_late_event_leaves_no_utilisation_behind(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path)
        await h.start()
        await h.send("gen1", Generated(0, 1, 2, 0, 1.0, 0.0))
        await h.trained(0)
        del h.driver.roles["gen1"]  # retired by a scale-down (scaling.Scaler._forget)
        h.driver.records.forget("gen1")
        await h.send("gen1", Generated(0, 1, 2, 0, 2.0, 0.0))  # its last news, late
        await h.trained(1)
        records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [("util/gen1" in r) for r in records] == [True, False]
        h.task.cancel()  # type: ignore[union-attr]
    asyncio.run(main())


def test_malformed_events_are_counted_and_a_used_up_restart_limit_stops(tmp_path):
    async def main() -> None:
        h = Harness(tmp_path)
        await h.start()
        h.events.queue.put_nowait(NodeEvent("gen0", "generated", {"step": "zero"}))
        h.events.queue.put_nowait(NodeEvent("gen0", "no_such_event", {}))
        await settle()
        assert h.driver.counts["bad_events"] == 2 and not h.task.done()  # type: ignore[union-attr]
        await h.send("gen1", NodeDead("exit code 1", will_restart=False))
        with pytest.raises(PipelineError, match="restart_limit = 2 restarts in a row.*"
                           "rlhf-async resume"):
            await h.task  # type: ignore[misc]
    asyncio.run(main())


def test_a_node_failure_or_a_full_disk_stops_the_run_naming_it(tmp_path, monkeypatch):
    async def failed() -> None:
        h = Harness(tmp_path)
        await h.start()
        await h.send("scorer0", Failed("task.reward: r.py:f called sys.exit(3) on prompt 2"))
        with pytest.raises(PipelineError, match=r"^scorer0: task.reward: r.py:f called "
                           r"sys.exit\(3\) on prompt 2 \(the run stops, its newest "
                           r"checkpoint kept: .*`rlhf-async resume .*`\)$"):
            await h.task  # type: ignore[misc]

    async def full_disk() -> None:
        h = Harness(tmp_path)
        await h.start()
        await h.trained(0)
        with pytest.raises(DiskFullError, match=f"^no space left on device writing "
                           f"{tmp_path / 'metrics.jsonl'}: .* free there$"):
            await h.task  # type: ignore[misc]

    asyncio.run(failed())

    def write(self, record):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(MetricsWriter, "write", write)
    asyncio.run(full_disk())


def test_events_that_came_before_every_node_loaded_are_handled_first(tmp_path):
    """A trainer with nothing left to train says `done` before the others have loaded; the
    wait for `loaded` hands that event on instead of dropping it (resume used to hang)."""
    async def main() -> None:
        early = [NodeEvent("trainer", "done", to_payload(Done("/p", 1)))]
        h = Harness(tmp_path, steps=1, backlog=early)
        assert await asyncio.wait_for(h.driver.run(), 5) == {"policy_dir": "/p", "steps": 1}
    asyncio.run(main())
