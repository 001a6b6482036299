"""The coordinator's typed clients of the Separation nodes, over a `ControlPlane`.

The Driver, the start-up and the trainer ranks' keeper ask nodes for things only through
these: a `TrainerClient` or `GeneratorClient` turns a method call into one typed command
(protocol.py) and returns its typed reply. `ControlPlane` is what they need of the
coordinator; the real `Coordinator` satisfies it, and so do the tests' fakes, which mypy
checks against it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from rlhf_async.log import get_logger
from rlhf_async.pipeline.protocol import (
    Connected,
    Joined,
    Receiving,
    Republish,
    Republished,
    TrainGroupConnect,
    TrainGroupPrepare,
    UpdateWeights,
    WeightSyncConnect,
    WeightSyncPrepare,
)
from rlhf_async.runtime.messages import Command, Stop
from rlhf_async.strategies.base import RunFailed
from rlhf_async.weight_sync import GroupSpec

R = TypeVar("R")
log = get_logger(component="pipeline")


class PipelineError(RunFailed):
    """The pipeline cannot go on (a node died too often, the weight broadcast failed)."""


class ControlPlane(Protocol):
    """What the Separation coordinator side needs of the coordinator (control/coordinator.py)."""

    async def call(self, node_id: str, cmd: Command[R], timeout: float = 10.0) -> R: ...

    async def wait_ready(self, node_ids: list[str] | None = None,
                         timeout: float | None = None) -> None: ...

    async def moves_followed(self) -> None: ...

    def host(self, node_id: str, default: str) -> str: ...

    def pid(self, node_id: str) -> int | None: ...

    def restart(self, node_id: str, reason: str, pid: int) -> bool: ...


class TrainerClient:
    """One trainer rank (rank 0, "trainer", unless told otherwise)."""

    def __init__(self, plane: ControlPlane, node: str = "trainer") -> None:
        self.plane, self.node = plane, node

    async def prepare_weight_sync(self, spec: GroupSpec) -> GroupSpec:
        return await self.plane.call(self.node, WeightSyncPrepare(spec))

    async def connect_weight_sync(self, spec: GroupSpec, timeout: float) -> Connected:
        return await self.plane.call(self.node, WeightSyncConnect(spec), timeout)

    async def republish(self, timeout: float) -> Republished:
        return await self.plane.call(self.node, Republish(), timeout)

    async def stop(self, reason: str, timeout: float) -> None:
        await self.plane.call(self.node, Stop(reason), timeout)

    async def prepare_group(self) -> int:
        """Rank 0 of several: the port the trainer group meets on."""
        return await self.plane.call(self.node, TrainGroupPrepare(), 30.0)

    async def join_group(self, addr: str, port: int, rank: int, world: int,
                         timeout: float) -> Joined:
        """Replied once every rank has joined (bounded by `timeout`)."""
        return await self.plane.call(
            self.node, TrainGroupConnect(addr, port, rank, world, timeout), timeout + 10)


class GeneratorClient:
    def __init__(self, plane: ControlPlane, node: str) -> None:
        self.plane, self.node = plane, node

    async def connect_weight_sync(self, spec: GroupSpec, rank: int,
                                  timeout: float) -> Connected:
        return await self.plane.call(self.node, WeightSyncConnect(spec, rank), timeout)

    async def update_weights(self, plan: dict[str, Any], lineage: str) -> Receiving:
        """The generator starts receiving the broadcast `plan` describes; replied at once."""
        return await self.plane.call(self.node, UpdateWeights(plan, lineage), 30.0)


def sync_group(spec: GroupSpec, trainer: str, generators: Iterable[str],
               ranks_each: int = 1) -> GroupSpec:
    """`spec` sized for the trainer (rank 0) and `ranks_each` ranks per generator: the
    first of generator i is 1 + i * ranks_each."""
    peers = [g if ranks_each == 1 else f"{g} worker {w}" for g in generators
             for w in range(ranks_each)]
    return GroupSpec(spec.backend, spec.master_addr, 0, 1 + len(peers), spec.name,
                     spec.epoch, spec.timeout_s, (trainer, *peers))


async def connect_weight_sync(trainer: TrainerClient, generators: list[GeneratorClient],
                              spec: GroupSpec, ranks_each: int = 1) -> GroupSpec:
    """Build (or rebuild, under `spec.epoch`) the trainer -> generators broadcast group,
    `ranks_each` ranks per generator (startup.generator_ranks). The generators start
    joining before the trainer does; every step is bounded."""
    spec = sync_group(spec, trainer.node, [g.node for g in generators], ranks_each)
    try:
        spec = await trainer.prepare_weight_sync(spec)
    except (TimeoutError, RuntimeError) as e:  # the trainer died or is restarting
        raise PipelineError(f"weight-sync group {spec.group_name}: {e}") from None
    limit = spec.timeout_s + 10
    joins = [asyncio.ensure_future(g.connect_weight_sync(spec, 1 + i * ranks_each, limit))
             for i, g in enumerate(generators)]
    await asyncio.sleep(0)  # let the generators' join commands go out first
    joins.insert(0, asyncio.ensure_future(trainer.connect_weight_sync(spec, limit)))
    # every join returns (each bounded by `limit`) before a failure is raised: a member
    # joins in a rendezvous its node cannot cut short, so a next epoch started while some
    # still wait in this one would meet without them (and fail again, on another member)
    got = await asyncio.gather(*joins, return_exceptions=True)
    errors = [x for x in got if isinstance(x, BaseException)]
    unexpected = [x for x in errors if not isinstance(x, TimeoutError | RuntimeError)]
    if unexpected:
        raise unexpected[0]
    if errors:  # the cause first: a member that failed, before those left waiting on it
        first = next((x for x in errors if not isinstance(x, TimeoutError)), errors[0])
        raise PipelineError(f"weight-sync group {spec.group_name}: {first}") from None
    log.info("weight_sync_connected", group=spec.group_name, world=spec.world_size)
    return spec
