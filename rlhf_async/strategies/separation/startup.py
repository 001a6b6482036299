"""Bringing a Separation run up: every node has loaded its models, and the trainer ->
generators weight-sync group is built (again, under a new epoch, after a node's restart)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlhf_async.control.client import EventStream, NodeEvent
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.log import get_logger
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.events import (
    Loaded,
    NodeDead,
    TrainGroupConnect,
    TrainGroupPrepare,
    UpdateWeights,
    WeightSyncConnect,
    WeightSyncPrepare,
    decode_event,
    encode,
)
from rlhf_async.weight_sync import GroupSpec

log = get_logger(component="pipeline")


class PipelineError(RuntimeError):
    """The pipeline cannot go on (a node died too often, the weight broadcast failed)."""


async def wait_loaded(events: EventStream, node_ids: list[str], timeout: float,
                      ranks: TrainerRanks | None = None
                      ) -> tuple[dict[str, Loaded], list[NodeEvent]]:
    """Wait until every node has loaded its models (its `loaded` event); also returns the
    other events that came meanwhile, for the Driver (a trainer with nothing left to train
    reports `done` before the others have loaded). A trainer rank that dies meanwhile
    takes its group down (`ranks`): every rank loads again."""
    waiting, loaded, backlog = set(node_ids), {}, []
    deadline = time.monotonic() + timeout
    while waiting:
        if ranks is not None and (error := ranks.failure()) is not None:
            raise error
        try:
            ev = await events.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() < deadline:
                continue
            raise PipelineError(f"nodes did not load their models within {timeout:.0f}s: "
                                f"{sorted(waiting)} (see RUN_DIR/logs)") from None
        if ev.kind == Loaded.kind:
            waiting.discard(ev.node_id)
            event = decode_event(ev.kind, ev.payload)
            assert isinstance(event, Loaded)
            loaded[ev.node_id] = event
        elif ev.kind == NodeDead.kind:
            dead = decode_event(ev.kind, ev.payload)
            assert isinstance(dead, NodeDead)
            if not dead.will_restart:  # else its replacement loads and says so
                raise PipelineError(f"node {ev.node_id} died while loading: {dead.reason}; "
                                    "its restarts (runtime.restart_limit) are used up "
                                    "(see RUN_DIR/logs)")
            log.warning("node_down_while_loading", node=ev.node_id, reason=dead.reason)
            waiting.add(ev.node_id)
            if ranks is not None:
                waiting.update(ranks.died(ev.node_id, dead.pid))
        else:
            backlog.append(ev)
    return loaded, backlog


def generator_ranks(p: Placement) -> int:
    """Weight-sync ranks of one generator: a vLLM generator's tensor-parallel workers each
    join the broadcast group (each receives the full weights and keeps its shard)."""
    shadow = p.model("shadow_actor")
    return shadow.tensor_parallel if shadow is not None else 1


def sync_group(spec: GroupSpec, trainer: str, generators: list[str],
               ranks_each: int = 1) -> GroupSpec:
    """`spec` sized for the trainer (rank 0) and `ranks_each` ranks per generator: the
    first of generator i is 1 + i * ranks_each."""
    peers = [g if ranks_each == 1 else f"{g} worker {w}" for g in generators
             for w in range(ranks_each)]
    return GroupSpec(spec.backend, spec.master_addr, 0, 1 + len(peers), spec.name,
                     spec.epoch, spec.timeout_s, (trainer, *peers))


async def connect_weight_sync(coord: Coordinator, spec: GroupSpec, trainer: str,
                              generators: list[str], ranks_each: int = 1) -> GroupSpec:
    """Build (or rebuild, under `spec.epoch`) the trainer -> generators broadcast group,
    `ranks_each` ranks per generator (generator_ranks). The generators start joining
    before the trainer does; every step is bounded."""
    spec = sync_group(spec, trainer, generators, ranks_each)
    try:
        prepare = WeightSyncPrepare(spec.to_dict())
        spec = GroupSpec.from_dict(await coord.command(trainer, prepare.kind, encode(prepare)))
    except (TimeoutError, RuntimeError) as e:  # the trainer died or is restarting
        raise PipelineError(f"weight-sync group {spec.group_name}: {e}") from None
    limit = spec.timeout_s + 10
    joins = [asyncio.ensure_future(command(coord, g, WeightSyncConnect(
        spec.to_dict(), 1 + i * ranks_each), limit)) for i, g in enumerate(generators)]
    await asyncio.sleep(0)  # let the generators' join commands go out first
    try:
        await asyncio.gather(command(coord, trainer, WeightSyncConnect(spec.to_dict()), limit),
                             *joins)
    except (TimeoutError, RuntimeError) as e:
        for j in joins:
            j.cancel()
        raise PipelineError(f"weight-sync group {spec.group_name}: {e}") from None
    log.info("weight_sync_connected", group=spec.group_name, world=spec.world_size)
    return spec


async def connect_trainer_group(coord: Coordinator, ranks: list[str], addr: str,
                                timeout: float) -> dict[str, int]:
    """Form the group of a multi-rank trainer (ranks[0] hosts the rendezvous at `addr`):
    every rank is told where to meet and answers once the group stands, with its pid.
    Bounded by `timeout`; a rank that died or never came is a PipelineError."""
    try:
        port = await coord.command(ranks[0], TrainGroupPrepare.kind, {}, timeout=30.0)
        replies = await asyncio.gather(*(
            command(coord, r, TrainGroupConnect(addr, int(port), i, len(ranks), timeout),
                    timeout + 10) for i, r in enumerate(ranks)))
    except (TimeoutError, RuntimeError) as e:
        raise PipelineError(f"trainer group {', '.join(ranks)}: {e}") from None
    log.info("trainer_group_connected", ranks=ranks, addr=addr, port=port)
    return {r: int(reply["pid"]) for r, reply in zip(ranks, replies, strict=True)}


class TrainerRanks:
    """The ranks of a multi-rank trainer, kept one group (strategies/separation/
    trainer_group.py). The group is its members' processes: one that dies breaks it, so
    `died` restarts the members still running, and a new group is formed from the new
    processes once all are up, in the background (`form`). A death while a group forms
    (ranks may be waiting in its rendezvous) restarts every rank and forms it afresh.
    With one rank there is nothing to keep."""

    def __init__(self, coord: Coordinator, ranks: list[str], addr: str,
                 timeout: float) -> None:
        self.coord, self.ranks, self.addr, self.timeout = coord, ranks, addr, timeout
        self.members: dict[str, int] = {}  # rank -> pid, of the group that stands
        self.joining: dict[str, int] = {}  # rank -> pid, told to join a group now
        self.gone: set[int] = set()  # pids of broken groups (and ones killed here)
        self.task: asyncio.Future[None] | None = None

    @property
    def grouped(self) -> bool:
        return len(self.ranks) > 1

    def form(self) -> None:
        """Form the group in the background; `failure` reports if it cannot."""
        if self.grouped and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._form())

    def failure(self) -> BaseException | None:
        task = self.task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def died(self, node: str, pid: int | None) -> list[str]:
        """Note that process `pid` of `node` died (it is being restarted). Returns the
        ranks restarted because of it."""
        if node not in self.ranks or not self.grouped or pid in self.gone:
            return []  # not a rank, or a process whose group is known to be broken
        if pid in self.members.values():
            killed = self._restart(self.members, f"its trainer group lost {node}")
            self.members = {}
        elif pid in self.joining.values():  # the others may wait in its rendezvous
            if self.task is not None:
                self.task.cancel()
            killed = self._restart(self._current(), f"{node} died while its trainer "
                                                    "group formed")
        else:
            return []  # never in a group: its replacement joins the one being formed
        self.form()
        return killed

    def _current(self) -> dict[str, int]:
        return {r: p for r in self.ranks if (p := self.coord.pid(r)) is not None}

    def _restart(self, pids: dict[str, int], reason: str) -> list[str]:
        self.gone.update(pids.values())
        return [r for r, pid in pids.items() if self.coord.restart(r, reason, pid)]

    async def _form(self) -> None:
        failures = 0
        while True:
            await self.coord.wait_ready(self.ranks)
            self.joining = self._current()
            try:
                # rank 0 hosts the rendezvous: where it runs now (moved on Ray: elsewhere)
                addr = self.coord.host(self.ranks[0], self.addr)
                pids = await connect_trainer_group(self.coord, self.ranks, addr, self.timeout)
            except PipelineError as e:
                failures += 1
                if failures > 2:
                    raise PipelineError(f"the trainer ranks did not form a group: {e}") \
                        from None
                log.warning("trainer_group_failed", error=str(e), attempt=failures)
                self._restart(self._current(), f"its trainer group did not form: {e}")
                continue
            finally:
                self.joining = {}
            if all(self.coord.pid(r) == pid for r, pid in pids.items()):
                self.members = pids
                return
            # a rank was restarted while the others joined: that group is broken already
            self._restart(pids, "a rank of its new trainer group restarted meanwhile")


async def command(coord: Coordinator, node: str,
                  cmd: WeightSyncConnect | UpdateWeights | TrainGroupConnect,
                  timeout: float) -> Any:
    return await coord.command(node, cmd.kind, encode(cmd), timeout)
