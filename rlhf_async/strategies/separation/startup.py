"""Bringing a Separation run up: every node has loaded its models, and the trainer ->
generators weight-sync group is built (again, under a new epoch, after a node's restart)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlhf_async.control.client import EventStream, NodeEvent
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.log import get_logger
from rlhf_async.strategies.separation.events import (
    Loaded,
    NodeDead,
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


async def wait_loaded(events: EventStream, node_ids: list[str],
                      timeout: float) -> tuple[dict[str, Loaded], list[NodeEvent]]:
    """Wait until every node has loaded its models (its `loaded` event); also returns the
    other events that came meanwhile, for the Driver (a trainer with nothing left to train
    reports `done` before the others have loaded)."""
    waiting, loaded, backlog = set(node_ids), {}, []
    deadline = time.monotonic() + timeout
    while waiting:
        try:
            ev = await events.get(timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
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
        else:
            backlog.append(ev)
    return loaded, backlog


async def connect_weight_sync(coord: Coordinator, spec: GroupSpec, trainer: str,
                              generators: list[str]) -> GroupSpec:
    """Build (or rebuild, under `spec.epoch`) the trainer -> generators broadcast group.
    The generators start joining before the trainer does; every step is bounded."""
    spec = GroupSpec(spec.backend, spec.master_addr, 0, 1 + len(generators), spec.name,
                     spec.epoch, spec.timeout_s, (trainer, *generators))
    try:
        prepare = WeightSyncPrepare(spec.to_dict())
        spec = GroupSpec.from_dict(await coord.command(trainer, prepare.kind, encode(prepare)))
    except (TimeoutError, RuntimeError) as e:  # the trainer died or is restarting
        raise PipelineError(f"weight-sync group {spec.group_name}: {e}") from None
    limit = spec.timeout_s + 10
    joins = [asyncio.ensure_future(command(coord, g, WeightSyncConnect(spec.to_dict(), r),
                                            limit)) for r, g in enumerate(generators, start=1)]
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


async def command(coord: Coordinator, node: str, cmd: WeightSyncConnect | UpdateWeights,
                   timeout: float) -> Any:
    return await coord.command(node, cmd.kind, encode(cmd), timeout)
