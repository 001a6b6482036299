"""Pipeline demo: source -> transform -> sink node processes under a coordinator.

Each source pushes `messages` tensors of `floats` float32 values (value = sequence number);
the transform doubles them; the sink checks order per producer and values, reports
progress events and a final `done` event with the throughput.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_async.coordinator import Coordinator, NodeEvent
from rlhf_async.protocol import Message, register_kind
from rlhf_async.runtime import Node, NodeSpec
from rlhf_async.transport import Endpoint, free_tcp_port, ipc_address

DEMO = register_kind("demo")


async def source(node: Node) -> None:
    out, floats = node.socket("out"), int(node.params["floats"])
    sent = 0
    for seq in range(int(node.params["messages"])):
        await node.wait_resumed()
        if node.stopping:
            break
        x = torch.full((floats,), float(seq))  # [F]
        await out.send(Message(DEMO, meta={"producer": node.node_id, "seq": seq},
                               tensors={"x": x}, source=node.node_id))
        sent += 1
        node.counters["sent"] = sent
    await node.emit("source_done", {"sent": sent})
    await node.wait_stop()  # exiting now would drop messages still queued (linger=0)


async def transform(node: Node) -> None:
    inp, out = node.socket("in"), node.socket("out")
    while not node.stopping:
        await node.wait_resumed()
        msg = await inp.recv()
        y = msg.tensors["x"] * 2  # [F]
        await out.send(Message(DEMO, meta=msg.meta, tensors={"x": y}, parent=msg.id,
                               source=node.node_id))
        node.counters["forwarded"] += 1


async def sink(node: Node) -> None:
    if node.params.get("stall"):  # a consumer that never reads: upstream must block at HWM
        await node.wait_stop()
        return
    inp, expect = node.socket("in"), int(node.params["expect"])
    every = max(1, int(node.params.get("progress_every", 1000)))
    next_seq: dict[str, int] = {}
    count = out_of_order = bad_values = nbytes = 0
    start = time.perf_counter()
    while count < expect:
        await node.wait_resumed()
        msg = await inp.recv()
        producer, seq = msg.meta["producer"], msg.meta["seq"]
        out_of_order += seq != next_seq.get(producer, 0)
        next_seq[producer] = seq + 1
        x = msg.tensors["x"]
        bad_values += not bool((x == 2.0 * seq).all())
        if count == 0:
            start = time.perf_counter()  # time the steady flow, not process start-up
        count += 1
        nbytes += x.numel() * x.element_size()
        node.counters["received"] = count
        if count % every == 0:
            await node.emit("progress", {"received": count, "expect": expect})
    seconds = max(time.perf_counter() - start, 1e-9)
    await node.emit("done", {
        "received": count, "bytes": nbytes, "seconds": seconds,
        "mb_per_s": nbytes / seconds / 1e6, "msgs_per_s": count / seconds,
        "out_of_order": out_of_order, "bad_values": bad_values, "last_seq": next_seq,
    })
    await node.wait_stop()


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
            if event.kind == "done":
                return dict(event.payload)
            if event.kind == "node_dead":
                return {"stopped": f"node {event.node_id} died: {event.payload['reason']}"}
    raise AssertionError("unreachable: the event stream does not end")
