"""A node under a flood of malformed messages rejects and counts every one of them and
keeps serving the good traffic mixed in between."""

import asyncio
import random

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from nodes.demo_pipeline import DEMO
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.control.demo import address_maker, build_specs
from rlhf_async.wire.protocol import Message, encode


def _good(seq):
    return [bytes(f) for f in encode(Message(DEMO, meta={"producer": "source0", "seq": seq},
                                             tensors={"x": torch.full((4,), float(seq))}))]


def _with_header(frames, **changes):
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def _malformed(rng):
    """Yields (category, frames) covering every way a message can be wrong."""
    good = _good(0)
    desc = msgpack.unpackb(good[0])["tensors"][0]
    makers = {
        "random_bytes": lambda: [rng.randbytes(rng.randint(0, 300))],
        "random_frames": lambda: [rng.randbytes(rng.randint(1, 50)) for _ in range(rng.randint(2, 5))],
        "truncated": lambda: [good[0], good[1][: rng.randint(0, len(good[1]) - 1)]],
        "oversized_frame": lambda: [good[0], good[1] + rng.randbytes(rng.randint(1, 64))],
        "missing_frame": lambda: [good[0]],
        "extra_frame": lambda: [*good, b"x"],
        "wrong_version": lambda: _with_header(good, v=rng.choice([0, 2, 99, "1", None])),
        "huge_declared": lambda: _with_header(
            good, tensors=[["x", "float32", [1 << 30, 1 << 10], 1]]),
        "unknown_kind": lambda: _with_header(good, kind=rng.choice(["evil", "", "rollout2"])),
        "unknown_dtype": lambda: _with_header(good, tensors=[["x", "float128", desc[2], 1]]),
        "wrong_types": lambda: _with_header(good, **rng.choice(
            [{"step": "1"}, {"meta": [1]}, {"id": 5}, {"ts": "now"}, {"wv": 1.5},
             {"tensors": {"x": 1}}, {"src": None}, {"parent": 3}])),
        "not_a_map": lambda: [msgpack.packb(rng.choice([[1, 2], 7, "hdr", None]))],
    }
    while True:
        name = rng.choice(sorted(makers))
        yield name, makers[name]()


@pytest.mark.timeout(120)
def test_malformed_flood_is_rejected_counted_and_good_traffic_flows(tmp_path, ipc_dir):
    n_bad, n_good = 1200, 300
    rng = random.Random(1234)
    addr = address_maker("ipc", ipc_dir)

    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            specs = build_specs(addr, messages=n_good, floats=4, hwm=64)
            specs = [s for s in specs if s.role != "source"]  # this test is the source
            with coord.events() as events:
                await coord.launch(specs)
                ctx = zmq.asyncio.Context()
                push = ctx.socket(zmq.PUSH)
                push.connect(specs[0].endpoints["in"].address)
                dealer = ctx.socket(zmq.DEALER)  # junk at the coordinator's control socket too
                dealer.connect(coord.control)
                try:
                    bad = _malformed(rng)
                    categories = set()
                    for i in range(n_bad):
                        name, frames = next(bad)
                        categories.add(name)
                        await push.send_multipart(frames)
                        if i % 4 == 0:  # good messages interleaved with the flood
                            await push.send_multipart(_good(i // 4))
                    for _ in range(50):
                        await dealer.send_multipart(next(bad)[1])
                    while True:
                        event = await events.get(timeout=60)
                        if event.kind == "done":
                            break
                finally:
                    push.close(0)
                    dealer.close(0)
                    ctx.term()
                status = await coord.command("transform0", "status")
                return categories, event.payload, status, coord.counters

    categories, done, status, coord_counters = asyncio.run(main())
    assert len(categories) == 12
    assert done["received"] == n_good and done["out_of_order"] == 0 and done["bad_values"] == 0
    assert status["counters"]["rejected"] == n_bad
    by_reason = {k: v for k, v in status["counters"].items() if k.startswith("rejected.")}
    assert sum(by_reason.values()) == n_bad and len(by_reason) >= 6
    assert coord_counters["rejected"] == 50
