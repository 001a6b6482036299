"""Pipeline demo: source -> transform -> sink node processes under a coordinator.

Each source pushes `messages` tensors of `floats` float32 values (value = sequence number);
the transform doubles them; the sink checks order per producer and values, reports
progress events and a final `done` event with the throughput. The coordinator's side
(specs, run to done) is `rlhf_async.control.demo`.
"""

from __future__ import annotations

import time

import torch

from rlhf_async.control.demo import DemoDone, DemoProgress, SourceDone
from rlhf_async.runtime import Node
from rlhf_async.wire.protocol import Message, register_kind

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
    await node.send_event(SourceDone(sent))
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
            await node.send_event(DemoProgress(count, expect))
    seconds = max(time.perf_counter() - start, 1e-9)
    await node.send_event(DemoDone(
        received=count, bytes=nbytes, seconds=seconds, mb_per_s=nbytes / seconds / 1e6,
        msgs_per_s=count / seconds, out_of_order=out_of_order, bad_values=bad_values,
        last_seq=next_seq))
    await node.wait_stop()
