"""Fuzz every socket kind a node or the coordinator reads: 100,000+ malformed messages.

A node's PULL data socket, the coordinator's ROUTER control socket and a node's DEALER
control socket each get tens of thousands of malformed multipart messages from a seeded
generator (every one checked locally to be rejected by `decode`, so the expected count per
reason is exact). Zero crashes, every message counted in the status counters, and good
traffic interleaved with the garbage still flows.
"""

import asyncio
import random
import threading
from collections import Counter

import msgpack
import pytest
import torch
import zmq

from nodes.demo_pipeline import DEMO
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.control.demo import build_specs
from rlhf_async.log import configure_logging
from rlhf_async.runtime import NodeSpec
from rlhf_async.runtime.launcher import LocalLauncher
from rlhf_async.wire.protocol import PROTOCOL_VERSION, Message, ProtocolError, decode, encode
from rlhf_async.wire.transport import Endpoint

SEED = 20261129
PULL_N, ROUTER_N, DEALER_N = 40_000, 30_000, 30_000
GOOD_EVERY = 200  # one valid message after this many malformed ones
JUNK = [None, True, -1, 2**63, 1.5, "s", b"b", [], {}, [1, [2]], {"k": None}]
FIELDS = ["v", "kind", "id", "parent", "src", "step", "wv", "ts", "meta", "tensors"]


@pytest.fixture(autouse=True)
def _logs():
    configure_logging("error")


def _header(rng: random.Random) -> tuple[dict, list[bytes]]:
    tensors, frames = [], []
    for i in range(rng.randint(0, 3)):
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
        n = 1
        for s in shape:
            n *= s
        tensors.append([f"t{i}", "float32", shape, i + 1])
        frames.append(rng.randbytes(4 * n))
    return ({"v": PROTOCOL_VERSION, "kind": "rollout", "id": f"x{rng.random()}",
             "parent": None, "src": "fuzz", "step": 0, "wv": 0, "ts": 0.0,
             "meta": {"k": rng.randint(0, 9)}, "tensors": tensors}, frames)


def _mutate(rng: random.Random) -> list[bytes]:
    h, frames = _header(rng)
    pick = rng.randrange(14)
    if pick == 0:
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
    if pick == 1:
        return [msgpack.packb(rng.choice([*JUNK[:-2], [h]])), *frames]
    if pick == 2:
        del h[rng.choice(FIELDS)]
    elif pick == 3:
        h[rng.choice(FIELDS)] = rng.choice(JUNK)
    elif pick == 4:
        h["v"] = rng.choice([0, 2, 99, -1, "1", 1.0])
    elif pick == 5:
        h["kind"] = rng.choice(["", "x" * 1000, "Rollout", "pickle", "__import__"])
    elif pick == 6:
        h["tensors"] = [[rng.choice(JUNK), rng.choice(["float32", "object", "f4", 7]),
                         rng.choice([[-1], [1] * 17, "3", [1.5]]), rng.choice([0, 1, 9])]]
    elif pick == 7:
        h["tensors"] = [["a", "float32", [1], 1], ["a", "float32", [1], 2]]
        frames = [b"\0" * 4, b"\0" * 4]
    elif pick == 8:
        frames = frames[:-1] if frames and rng.random() < 0.5 else [*frames, b"extra"]
    elif pick == 9:
        h["tensors"] = [["x", "float32", [rng.randint(1, 100)], 1]]
        frames = [rng.randbytes(rng.choice([0, 3, 401]))]
    elif pick == 10:
        h["tensors"] = [["x", "float64", [2**40, 2**30], 1]]
        frames = [b""]
    elif pick == 11:
        return [b"\x91" * 5000 + b"\xc0", *frames]  # arrays nested 5000 deep
    elif pick == 12:
        return [msgpack.packb(h)[: rng.randint(1, 20)], *frames]
    else:
        h["meta"] = {rng.randint(0, 9): 1}  # non-string map keys
    return [msgpack.packb(h), *frames]


def malformed(rng: random.Random, n: int) -> tuple[list[list[bytes]], Counter[str]]:
    """`n` messages that `decode` rejects, and how many it rejects for each reason."""
    out, reasons = [], Counter()
    while len(out) < n:
        frames = _mutate(rng)
        try:
            decode(frames)
        except ProtocolError as e:
            reasons[e.reason] += 1
            out.append(frames)
    return out, reasons


def _good(seq: int) -> list[bytes]:
    msg = Message(DEMO, meta={"producer": "good", "seq": seq}, tensors={"x": torch.full((4,), float(seq))})
    return [bytes(f) for f in encode(msg)]


def _send_all(address: str, messages: list[list[bytes]], sock_type: int, counted: threading.Event,
              good_every: int = 0) -> int:
    """Blocking sender for a thread (the coordinator's loop must keep running). The socket
    stays open until the receiver counted everything: libzmq may drop what is still queued
    when a socket closes, linger or not."""
    ctx = zmq.Context()
    sock = ctx.socket(sock_type)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(address)
    good = 0
    try:
        for i, frames in enumerate(messages):
            sock.send_multipart(frames)
            if good_every and i % good_every == good_every - 1:
                sock.send_multipart(_good(good))
                good += 1
        counted.wait(120)
    finally:
        sock.close(0)
        ctx.term()
    return good


def _expect(counters: dict, sent: Counter) -> None:
    assert counters.get("rejected", 0) == sum(sent.values()), (counters, sent)
    for reason, n in sent.items():
        assert counters.get(f"rejected.{reason}", 0) == n, (reason, counters, sent)


async def _counted(read, total: int, unknown: int = 0) -> dict:
    for _ in range(600):
        counters = await read()
        if (counters.get("rejected", 0) >= total
                and counters.get("control.unknown_peer", 0) >= unknown):
            return counters
        await asyncio.sleep(0.1)
    return counters


@pytest.mark.timeout(180)
def test_pull_and_router_survive_and_count_malformed_messages(tmp_path):
    rng = random.Random(SEED)
    pull_msgs, pull_reasons = malformed(rng, PULL_N)
    router_msgs, router_reasons = malformed(rng, ROUTER_N)
    foreign = [[bytes(f) for f in encode(Message(k, source=s))]
               for k in ("heartbeat", "ready", "event", "reply", "stop")
               for s in ("intruder", "transform0")]  # unknown node, and a spoofed one
    sock_dir = tmp_path / "s"
    good_n = PULL_N // GOOD_EVERY

    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            specs = [s for s in build_specs(lambda n: f"ipc://{sock_dir}/{n}", messages=good_n,
                                            floats=4, hwm=32, progress_every=good_n)
                     if s.role != "source"]
            counted = threading.Event()
            with coord.events() as events:
                await coord.launch(specs)
                address = specs[0].endpoints["in"].address
                pull = asyncio.ensure_future(asyncio.to_thread(
                    _send_all, address, pull_msgs, zmq.PUSH, counted, GOOD_EVERY))
                router = asyncio.ensure_future(asyncio.to_thread(
                    _send_all, coord.control, router_msgs + foreign, zmq.DEALER, counted))
                try:
                    while (event := await events.get(timeout=120)).kind != "done":
                        assert event.kind != "node_dead", event
                    assert event.payload["received"] == good_n
                    assert event.payload["bad_values"] == event.payload["out_of_order"] == 0

                    async def node_counters():
                        return (await coord.command("transform0", "status"))["counters"]

                    async def coord_counters():
                        return coord.status()["counters"]

                    node = await _counted(node_counters, PULL_N)
                    counters = await _counted(coord_counters, ROUTER_N, len(foreign))
                finally:
                    counted.set()
                    assert (await asyncio.gather(pull, router))[0] == good_n
            _expect(node, pull_reasons)
            _expect(counters, router_reasons)
            assert counters["control.unknown_peer"] == len(foreign)
            assert counters.get("control.errors", 0) == 0
            assert {n["state"] for n in coord.status()["nodes"].values()} == {"ready"}

    asyncio.run(main())


def _fake_coordinator(address: str, messages: list[list[bytes]], result: dict) -> None:
    """Plays the coordinator for one node: garbage down its DEALER, then asks for status."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDTIMEO, 30_000)
    router.setsockopt(zmq.RCVTIMEO, 60_000)
    router.bind(address)
    try:
        # the node's identity on the control socket is its incarnation's (`peer_id`)
        while decode((frames := router.recv_multipart())[1:]).kind != "ready":
            pass
        node_id = frames[0]
        alive = [bytes(f) for f in encode(Message("heartbeat", source="coordinator"))]
        for i, frames in enumerate(messages):
            router.send_multipart([node_id, *frames])
            if i % 1000 == 0:  # the node counts only valid traffic as a sign of life
                router.send_multipart([node_id, *alive])
        for name in ("status", "stop"):
            cmd = Message("command", source="coordinator", meta={"name": name})
            router.send_multipart([node_id, *[bytes(f) for f in encode(cmd)]])
            while (reply := decode(router.recv_multipart()[1:])).parent != cmd.id:
                pass
            result[name] = reply.meta
    finally:
        router.close(0)
        ctx.term()


@pytest.mark.timeout(180)
def test_node_dealer_control_survives_and_counts_malformed_messages(tmp_path):
    messages, reasons = malformed(random.Random(SEED + 1), DEALER_N)
    control = f"ipc://{tmp_path}/ctl"
    spec = NodeSpec("sink", "sink0", "nodes.demo_pipeline:sink", control=control,
                    endpoints={"in": Endpoint("pull", f"ipc://{tmp_path}/in", bind=True)},
                    params={"stall": True}, orphan_timeout_s=60.0)
    result: dict = {}
    thread = threading.Thread(target=_fake_coordinator,
                              args=(control, messages, result))
    thread.start()
    proc = LocalLauncher().launch(spec, tmp_path / "run")
    try:
        thread.join(150)
        assert not thread.is_alive()
        assert result["status"]["ok"], result
        _expect(result["status"]["result"]["counters"], reasons)
        assert asyncio.run(proc.wait(timeout=30)) == 0  # stopped on request, not crashed
    finally:
        proc.kill()
