"""Bringing a Separation run up: every node has loaded its models (the trainer ->
generators weight-sync group is built by `clients.connect_weight_sync`)."""

from __future__ import annotations

import time

from rlhf_async.control.client import EventStream, NodeEvent
from rlhf_async.log import get_logger
from rlhf_async.pipeline.protocol import EventError, Loaded, NodeDead, decode_event
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.separation.clients import PipelineError
from rlhf_async.strategies.separation.trainer_ranks import TrainerRanks

log = get_logger(component="pipeline")


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
        try:
            event = decode_event(ev)
        except EventError:  # the Driver counts it
            event = None
        match event:
            case Loaded():
                waiting.discard(ev.node_id)
                loaded[ev.node_id] = event
            case NodeDead():
                if not event.will_restart:  # else its replacement loads and says so
                    raise PipelineError(f"node {ev.node_id} died while loading: "
                                        f"{event.reason}; its restarts "
                                        "(runtime.restart_limit) are used up (see RUN_DIR/logs)")
                log.warning("node_down_while_loading", node=ev.node_id, reason=event.reason)
                waiting.add(ev.node_id)
                if ranks is not None:
                    waiting.update(ranks.died(ev.node_id, event.pid))
            case _:
                backlog.append(ev)
    return loaded, backlog


def generator_ranks(p: Placement) -> int:
    """Weight-sync ranks of one generator: a tensor-parallel generator's engine workers each
    join the broadcast group (each receives the full weights and keeps its shard)."""
    shadow = p.model("shadow_actor")
    return shadow.tensor_parallel if shadow is not None else 1
