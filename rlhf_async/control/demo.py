"""The pipeline demo's coordinator side: source -> transform -> sink node processes
(their programs are `nodes/demo_pipeline.py`), run until the sink reports `done`."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rlhf_async.control.client import NodeDead, NodeEvent
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.runtime.messages import MessageError, Msg, from_payload, tag
from rlhf_async.runtime.spec import NodeSpec
from rlhf_async.wire.local import free_tcp_port
from rlhf_async.wire.transport import Endpoint, ipc_address

# ---- the demo's events (sent by nodes/demo_pipeline.py) -----------------------------------

class SourceDone(Msg, frozen=True, tag="source_done"):
    sent: int


class DemoProgress(Msg, frozen=True, tag="progress"):
    received: int
    expect: int


class DemoDone(Msg, frozen=True, tag="done"):
    """The sink has every message: what arrived, how fast, and in what order."""

    received: int
    bytes: int
    seconds: float
    mb_per_s: float
    msgs_per_s: float
    out_of_order: int
    bad_values: int
    last_seq: dict[str, int]  # producer -> next sequence number expected


DEMO_EVENTS: dict[str, type[Msg]] = {tag(c): c for c in (SourceDone, DemoProgress, DemoDone,
                                                         NodeDead)}


def build_specs(addr: Callable[[str], str], *, messages: int, floats: int, hwm: int,
                sources: int = 1, stall: bool = False,
                progress_every: int = 1000) -> list[NodeSpec]:
    """Specs for `sources` sources -> one transform -> one sink; `addr(name)` makes addresses."""
    mid, end = addr("transform-in"), addr("sink-in")
    specs = [
        NodeSpec("source", f"source{i}", "nodes.demo_pipeline:source",
                 endpoints={"out": Endpoint("push", mid, hwm=hwm)},
                 params={"messages": messages, "floats": floats})
        for i in range(sources)
    ]
    specs.append(NodeSpec("transform", "transform0", "nodes.demo_pipeline:transform",
                          endpoints={"in": Endpoint("pull", mid, bind=True, hwm=hwm),
                                     "out": Endpoint("push", end, hwm=hwm)}))
    specs.append(NodeSpec("sink", "sink0", "nodes.demo_pipeline:sink",
                          endpoints={"in": Endpoint("pull", end, bind=True, hwm=hwm)},
                          params={"expect": messages * sources, "stall": stall,
                                  "progress_every": progress_every}))
    return specs


def address_maker(scheme: str, ipc_dir: str) -> Callable[[str], str]:
    if scheme == "ipc":
        return lambda name: ipc_address(ipc_dir, name)
    if scheme == "tcp":
        return lambda name: f"tcp://127.0.0.1:{free_tcp_port()}"
    raise ValueError(f"transport {scheme!r} not one of ipc, tcp")


async def run_demo(run_dir: str | Path, *, transport: str = "ipc", messages: int = 10000,
                   floats: int = 256, hwm: int = 64, sources: int = 1,
                   on_event: Callable[[NodeEvent], Any] | None = None,
                   handle_signals: bool = False) -> dict[str, Any]:
    """Run the pipeline to completion; returns the sink's `done` payload, or `{"stopped": why}`."""
    ipc_dir = tempfile.mkdtemp(prefix="rlhf-demo-", dir="/tmp")  # unix socket paths are short
    try:
        async with Coordinator(run_dir) as coord:
            if handle_signals:
                coord.install_signal_handlers()
            if on_event is not None:
                coord.on_event(on_event)
            specs = build_specs(address_maker(transport, ipc_dir), messages=messages,
                                floats=floats, hwm=hwm, sources=sources,
                                progress_every=max(1, messages * sources // 10))
            result = await coord.run_until_stop(_until_done(coord, specs))
            return result if result is not None else {"stopped": coord.stop_reason}
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


async def _until_done(coord: Coordinator, specs: list[NodeSpec]) -> dict[str, Any]:
    with coord.events() as events:
        await coord.launch(specs)
        async for event in events:
            try:
                typed = demo_event(event)
            except MessageError as e:
                return {"stopped": f"node {event.node_id} sent a bad event: {e}"}
            match typed:
                case DemoDone():
                    return msgspec.structs.asdict(typed)
                case NodeDead(reason=reason):
                    return {"stopped": f"node {event.node_id} died: {reason}"}
    raise AssertionError("unreachable: the event stream does not end")


def demo_event(event: NodeEvent) -> Msg | None:
    """The demo's typed event (or a death); None for the coordinator's other events."""
    cls = DEMO_EVENTS.get(event.kind)
    return None if cls is None else from_payload(cls, event.payload)
