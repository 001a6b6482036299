"""The coordinator's side of the Separation pipeline.

It owns the data cursor: prompts of step s go out (cut into chunks) only when the staleness
gate allows, i.e. when every live generator has applied a recent enough weight version of
the current trainer's lineage. It forwards each weight publication to the generators, turns
node events into one metrics record per trained step (`StepRecords`, records.py), re-sends
chunks the trainer refused, and recovers from node deaths: chunks a dead node held are sent
again (the trainer drops duplicates, so each prompt is trained on exactly once), a
restarted trainer continues from its checkpoint, and the weight-broadcast group is rebuilt
under a new epoch (`SyncGroup`, sync_group.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from rlhf_async.config import JobConfig
from rlhf_async.control.client import NodeEvent, NodeExited
from rlhf_async.log import get_logger
from rlhf_async.modeling.flops import Utilization
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.pipeline.protocol import (
    SFT_LINEAGE,
    ChunkDropped,
    ChunkId,
    Done,
    Event,
    EventError,
    Failed,
    Generated,
    Loaded,
    NodeDead,
    NodeReady,
    NodeRestarted,
    Published,
    Received,
    Scored,
    Trained,
    WeightsApplied,
    WeightSyncFailed,
    decode_event,
    prompts_message,
)
from rlhf_async.rl.staleness import StalenessPolicy
from rlhf_async.strategies.separation.clients import (
    ControlPlane,
    GeneratorClient,
    PipelineError,
    TrainerClient,
)
from rlhf_async.strategies.separation.holdings import Holdings
from rlhf_async.strategies.separation.records import StepRecords
from rlhf_async.strategies.separation.sync_group import SyncGroup
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks
from rlhf_async.task import make_task
from rlhf_async.weight_sync import GroupSpec
from rlhf_async.wire.protocol import Message

log = get_logger(component="pipeline")
Key = tuple[int, int]  # (step, chunk)


class Events(Protocol):  # the coordinator's EventStream
    async def get(self, timeout: float | None = None) -> NodeEvent: ...


class Prompts(Protocol):  # the generators' queue (a wire.transport Channel)
    async def send(self, msg: Message, timeout: float | None = None) -> None: ...


class ChunkState(enum.StrEnum):
    """Where a chunk of a step's prompts is; it is forgotten once its step is trained."""

    DISPATCHED = "dispatched"  # sent to the generators' queue
    GENERATED = "generated"  # rollouts past a generator, not yet held by the trainer
    SCORED = "scored"  # held by the trainer (its `Received`), waiting for their step


class Driver:
    """The coordinator's side of a Separation run: a state machine over node events.

    State: the data cursor (`next_step`), each chunk's `ChunkState`, the weights each
    generator holds (`applied`), which nodes are down, the live trainer's `lineage`.
    Everything it does is an answer to one event (`_handle`) or the dispatch loop
    waking up when the staleness gate opens.
    """

    def __init__(self, cfg: JobConfig, coord: ControlPlane, events: Events,
                 prompts: Prompts, roles: dict[str, str], spec: GroupSpec, run_dir: Path,
                 chunks_per_step: int, start_step: int, lineage: str, ranks: TrainerRanks,
                 backlog: list[NodeEvent] | None = None, gen_ranks: int = 1,
                 utilization: Utilization | None = None) -> None:
        self.cfg, self.coord, self.events, self.chan = cfg, coord, events, prompts
        self.trainer = TrainerClient(coord)
        self.clients = {n: GeneratorClient(coord, n) for n, r in roles.items()
                        if r == "generator"}
        self.roles, self.run_dir, self.chunks = roles, run_dir, chunks_per_step
        self.policy = StalenessPolicy(cfg.algo.max_staleness, cfg.train.publish_every)
        self.task = make_task(cfg)
        # generator -> (version, lineage) of the weights it holds; all start from the SFT
        self.applied = Holdings(n for n, r in roles.items() if r == "generator")
        self.lineage = lineage  # the live trainer's incarnation
        self.gate = asyncio.Event()
        self.next_step = self.start_step = start_step
        self.chunk_state: dict[Key, ChunkState] = {}
        self.chunk_prompts: dict[Key, tuple[ChunkId, PromptBatch]] = {}
        self.down: set[str] = set()
        self.joining: set[str] = set()  # started by a scale (scaling.py): nothing to hand back
        self.leaving: set[str] = set()  # retiring (scaling.py): out of the next sync group
        self.ranks = ranks  # the trainer's, rank 0 ("trainer") first; several: one group
        self.trained_ids = Counter[int]()
        self.counts = Counter[str]()  # restarts, resent chunks, regroups
        self.sync = SyncGroup(coord, self.trainer, self.clients, spec, gen_ranks,
                              cfg.runtime.restart_limit, cfg.weight_sync.timeout_s,
                              self.counts, generators=lambda: [
                                  g for g in self.generators if g not in self.leaving],
                              trainer_up=lambda: "trainer" not in self.down)
        self.records = StepRecords(cfg, run_dir, self.task, start_step, roles, utilization)
        self.result: dict[str, Any] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._backlog = list(backlog or [])  # events that came before every node loaded

    @property
    def generators(self) -> list[str]:
        return [n for n in self.applied if n not in self.down]

    async def run(self) -> dict[str, Any]:
        self.dispatcher = asyncio.ensure_future(self._dispatch_loop())
        if self.start_step:  # generators hold the SFT weights: send the checkpoint's
            self.spawn(self.sync.republish())
        try:
            while True:
                if await self._handle(await self._next_event()):
                    return self.result
        finally:
            self.dispatcher.cancel()
            for task in list(self._tasks):
                task.cancel()
            self.sync.close()
            self.records.close()

    async def finish_stopping(self, grace: float) -> None:
        """After a stop request: no more prompts; the trainer is asked to stop, finishes
        its step and checkpoints, and every step it reports meanwhile is still written to
        metrics.jsonl (a checkpoint never holds a step the metrics lack)."""
        self.dispatcher.cancel()
        self.records.open()
        with contextlib.suppress(TimeoutError, RuntimeError):  # it may be gone already
            await self.trainer.stop("run stopping", timeout=2.0)
        deadline = time.monotonic() + grace
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    ev = self._backlog.pop(0) if self._backlog else \
                        await self.events.get(timeout=left)
                except TimeoutError:
                    log.warning("trainer_stop_timeout", grace_s=grace)
                    return
                event = self._decode(ev)
                if ev.node_id == "trainer" and isinstance(event, NodeExited | NodeDead):
                    return
                if event is not None and not isinstance(event, NodeDead):
                    await self._on(ev.node_id, event)  # records, weights forwarded as usual
        finally:
            self.records.writer.close()

    async def _next_event(self) -> NodeEvent:
        """The next node event, or the failure of a background task that must not fail."""
        if self._backlog:
            return self._backlog.pop(0)
        get = asyncio.ensure_future(self.events.get())
        watched: set[asyncio.Future[Any]] = {
            t for t in (self.dispatcher, self.sync.task, self.ranks.task) if t is not None}
        try:
            await asyncio.wait({get, *watched}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # a stop: an event already taken must not be lost
            if get.done() and not get.cancelled():
                self._backlog.insert(0, get.result())
            get.cancel()
            raise
        for task, what in ((self.dispatcher, "dispatching prompts"),
                           (self.sync.task, "rebuilding the weight-sync group"),
                           (self.ranks.task, "re-forming the trainer group")):
            if task is not None and task.done() and not task.cancelled() and \
                    task.exception() is not None:
                get.cancel()
                raise PipelineError(f"{what} failed: {task.exception()}")
        return await get

    def _published(self) -> int | None:
        """Oldest version the live generators hold, if all hold the live trainer's weights."""
        return self.applied.published(self.lineage, self.down)

    async def _dispatch_loop(self) -> None:
        g = self.cfg.algo.group_size
        while self.next_step < self.cfg.train.steps:
            step = self.next_step
            while (v := self._published()) is None or not self.policy.can_dispatch(step, v):
                self.gate.clear()
                await self.gate.wait()
            prompts = self.task.prompt_batch(self.cfg.run.seed, "train", step,
                                             self.cfg.train.prompts_per_step, g)
            parts = prompts.split(g, self.chunks)
            for c, part in enumerate(parts):
                self.chunk_prompts[(step, c)] = (ChunkId(step, c, len(parts)), part)
                await self._send((step, c))
            self.next_step = step + 1

    async def _send(self, key: Key) -> None:
        cid, part = self.chunk_prompts[key]
        self.chunk_state[key] = ChunkState.DISPATCHED
        await self.chan.send(prompts_message(cid, part, "coordinator"))

    def resend(self, states: tuple[ChunkState, ...]) -> None:
        """Send again every chunk not yet trained that is in one of `states`."""
        keys = sorted(k for k, s in self.chunk_state.items() if s in states)
        self.counts["resent_chunks"] += len(keys)

        async def resend() -> None:
            # a node restarted on another host: its peers follow it first, or a chunk sent
            # again could go to its old address
            await self.coord.moves_followed()
            for key in keys:
                if key in self.chunk_state:  # not trained meanwhile
                    await self._send(key)
        self.spawn(resend())

    async def _handle(self, ev: NodeEvent) -> bool:
        """One node event; True when the run is complete."""
        event = self._decode(ev)
        return event is not None and await self._on(ev.node_id, event)

    def _decode(self, ev: NodeEvent) -> Event | None:
        """The typed event; None (logged and counted, never fatal) for a payload that is
        not the record its kind names."""
        try:
            return decode_event(ev)
        except EventError as e:
            self.counts["bad_events"] += 1
            log.warning("bad_event", node=ev.node_id, kind=ev.kind, error=str(e))
            return None

    async def _on(self, node: str, event: Event) -> bool:
        match event:
            case Published(plan=plan, lineage=lineage):
                for gen in self.generators:
                    self.spawn(self.sync.forward(gen, plan, lineage))
            case WeightsApplied(version=version, lineage=lineage):
                self.applied[node] = (version, lineage)
                self.gate.set()
            case Generated() | Scored():
                # a scored chunk stays GENERATED: its rollout may still be in the scorer's
                # socket queue when this event arrives (`Received` moves it on)
                key = (event.step, event.chunk)
                if self.chunk_state.get(key) == ChunkState.DISPATCHED:  # never backwards
                    self.chunk_state[key] = ChunkState.GENERATED
                if node in self.roles:  # not a retired node's late event (`forget` was)
                    self.records.busy[node] = event.busy_s
                if isinstance(event, Generated) and event.episode_error:
                    self.records.episode_error(event.step, event.episode_error)
            case Received():
                key = (event.step, event.chunk)
                if key in self.chunk_state:
                    self.chunk_state[key] = ChunkState.SCORED
            case ChunkDropped():
                key = (event.step, event.chunk)
                if key in self.chunk_prompts:
                    self.counts["resent_chunks"] += 1
                    self.spawn(self._send(key))
            case Trained():
                self._record(node, event)
            case Done():
                self.result = {"policy_dir": event.policy_dir, "steps": event.steps}
                return True
            case Failed(error=error):  # a restart would repeat it: stop with the cause
                raise PipelineError(f"{node}: {error} (the run stops, its newest checkpoint "
                                    "kept: once fixed, continue with `rlhf-async resume "
                                    f"{self.run_dir}`)")
            case NodeDead():
                await self._node_dead(node, event)
            case Loaded() if node in self.down:
                await self._recover(node, event)
            case WeightSyncFailed(error=error):
                log.warning("weight_sync_failed", node=node, error=error)
            case NodeReady() | NodeExited() | NodeRestarted() | Loaded():
                pass  # the coordinator's bookkeeping; a first load (start-up's)
        return False

    async def _node_dead(self, node: str, dead: NodeDead) -> None:
        if not dead.will_restart:
            raise PipelineError(
                f"node {node} died ({dead.reason}) after runtime.restart_limit = "
                f"{self.cfg.runtime.restart_limit} restarts in a row; the run stops with a "
                f"checkpoint: continue it with `rlhf-async resume {self.run_dir}`")
        self.down.add(node)
        # a node dying while it joins may hold prompts it pulled while loading: its restart
        # hands them back like any other's
        self.joining.discard(node)
        self.counts["restarts"] += 1
        log.warning("node_down", node=node, role=self.roles[node], reason=dead.reason)
        if self.roles[node] == "generator":
            self.sync.rebuild()  # the others go on while it restarts
        # a trainer rank: its group is gone; the other ranks restart too, and rank 0
        # resumes from its checkpoint once the new group stands (`_recover`)
        self.down.update(self.ranks.died(node, dead.pid))

    async def _recover(self, node: str, loaded: Loaded) -> None:
        """A restarted node has loaded its models: give it back its share of the work."""
        self.down.discard(node)
        role = self.roles[node]
        log.info("node_recovered", node=node, role=role)
        if node in self.ranks.ranks[1:]:  # a rank that rank 0 leads: rank 0 recovers
            return
        if node in self.joining:  # new (scaled up): nothing of it to send again
            self.joining.discard(node)
        elif role == "trainer":
            await self._rollback(loaded.step, loaded.lineage)
        else:
            if role == "generator":
                self.applied[node] = (0, SFT_LINEAGE)
            # lost in a queue or in flight; past a generator but not yet at the trainer
            # too: a node's event can overtake the rollout still in its socket's queue when
            # it was killed (a copy that got through is dropped by the trainer as a duplicate)
            self.resend((ChunkState.DISPATCHED, ChunkState.GENERATED))
        if role != "scorer":
            self.sync.rebuild()

    async def _rollback(self, step: int, lineage: str) -> None:
        """The trainer restarted from the checkpoint of `step`: dispatch again from there;
        records of steps it lost are dropped, they will be trained (and logged) again."""
        self.dispatcher.cancel()
        self.lineage, self.next_step = lineage, step
        self.chunk_state.clear()
        self.chunk_prompts.clear()
        self.records.rollback(step)
        first = step * self.cfg.train.prompts_per_step * self.cfg.algo.group_size
        for sid in [s for s in self.trained_ids if s >= first]:
            del self.trained_ids[sid]
        self.dispatcher = asyncio.ensure_future(self._dispatch_loop())

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, trainer: str, t: Trained) -> None:
        for s in t.sample_ids:
            self.trained_ids[s] += 1
        for key in [k for k in self.chunk_state if k[0] <= t.step]:
            del self.chunk_state[key], self.chunk_prompts[key]
        states = Counter(self.chunk_state.values())
        self.records.write(trainer, t, published_version=self._published(),
                           **{f"queue/{s}": states.get(s, 0) for s in ChunkState},
                           **{f"faults/{k}": v for k, v in self.counts.items()})
