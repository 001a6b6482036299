import asyncio

import pytest
import torch
import zmq

from rlhf_async.wire.local import free_tcp_port
from rlhf_async.wire.protocol import Message, encode
from rlhf_async.wire.transport import Endpoint, EndpointError, Transport, ipc_address

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_push_pull_roundtrip(scheme, ipc_dir):
    addr = ipc_address(ipc_dir, "q") if scheme == "ipc" else f"tcp://127.0.0.1:{free_tcp_port()}"

    async def main():
        async with Transport() as t:
            pull = t.channel(Endpoint("pull", addr, bind=True))
            push = t.channel(Endpoint("push", addr))
            for i in range(5):
                await push.send(Message("rollout", meta={"i": i},
                                        tensors={"x": torch.full((3,), float(i))}))
            got = [await pull.recv(timeout=5) for _ in range(5)]
            assert [m.meta["i"] for m in got] == list(range(5))
            assert torch.equal(got[4].tensors["x"], torch.full((3,), 4.0))

    asyncio.run(main())


def test_router_dealer_addressing(ipc_dir):
    addr = ipc_address(ipc_dir, "ctl")

    async def main():
        async with Transport() as t:
            router = t.channel(Endpoint("router", addr, bind=True))
            dealer = t.channel(Endpoint("dealer", addr, identity="node-a"))
            await dealer.send(Message("heartbeat", source="node-a"))
            peer, msg = await router.recv_from(timeout=5)
            assert peer == b"node-a" and msg.kind == "heartbeat"
            await router.send(msg.reply("reply", meta={"ok": True}), to=peer)
            answer = await dealer.recv(timeout=5)
            assert answer.parent == msg.id and answer.meta == {"ok": True}
            with pytest.raises(ValueError, match="needs `to`"):
                await router.send(Message("reply"))

    asyncio.run(main())


def test_hwm_backpressure_and_timeouts(ipc_dir):
    addr = ipc_address(ipc_dir, "bp")

    async def main():
        async with Transport() as t:
            pull = t.channel(Endpoint("pull", addr, bind=True, hwm=2))
            push = t.channel(Endpoint("push", addr, hwm=2))
            with pytest.raises(TimeoutError):
                await pull.recv(timeout=0.05)
            big = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MB fills kernel buffers fast
            sent = 0
            with pytest.raises(TimeoutError):
                for _ in range(1000):
                    await push.send(Message("rollout", tensors={"b": big}), timeout=0.5)
                    sent += 1
            assert 2 <= sent < 1000  # blocked at the high-water mark, not buffered without bound
            for _ in range(sent):
                await pull.recv(timeout=5)

    asyncio.run(main())


def test_malformed_messages_are_counted_and_skipped(ipc_dir):
    addr = ipc_address(ipc_dir, "bad")

    async def main():
        async with Transport() as t:
            pull = t.channel(Endpoint("pull", addr, bind=True))
            raw = t.ctx.socket(zmq.PUSH)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(addr)
            good = encode(Message("rollout", meta={"ok": 1}, tensors={"x": torch.ones(2)}))
            await raw.send_multipart([b"junk"])
            await raw.send_multipart([bytes(good[0])])  # missing tensor frame
            await raw.send_multipart([bytes(good[0]), b"123"])  # truncated frame
            await raw.send_multipart(good)
            msg = await pull.recv(timeout=5)
            raw.close()
            assert msg.meta == {"ok": 1}
            assert t.counters["rejected"] == 3
            assert t.counters["rejected.malformed_header"] == 1
            assert t.counters["rejected.frame_count"] == 1
            assert t.counters["rejected.frame_size"] == 1

    asyncio.run(main())


def test_close_cancels_tasks_and_closes_sockets(ipc_dir):
    async def main():
        t = Transport()
        chan = t.channel(Endpoint("pull", ipc_address(ipc_dir, "c"), bind=True))
        task = t.spawn(chan.recv(), name="waiter")
        await asyncio.sleep(0)
        await t.close()
        assert task.cancelled() and chan.sock.closed and t.ctx.closed

    asyncio.run(main())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"type": "pair", "address": "ipc:///tmp/x"}, "type"),
        ({"type": "push", "address": "udp://x"}, "ipc:// or tcp://"),
        ({"type": "push", "address": "ipc:///" + "a" * 200}, "shorter directory"),
        ({"type": "push", "address": "tcp://127.0.0.1:1", "hwm": 0}, "hwm"),
    ],
)
def test_endpoint_validation(kwargs, match):
    with pytest.raises(EndpointError, match=match):
        Endpoint(**kwargs)


def test_endpoint_dict_roundtrip_and_unknown_keys():
    ep = Endpoint("push", "tcp://127.0.0.1:5555", hwm=4)
    assert Endpoint.from_dict(ep.to_dict()) == ep
    with pytest.raises(EndpointError, match="accepts"):
        Endpoint.from_dict({"type": "push", "address": "tcp://h:1", "color": "red"})


def test_bind_failure_is_a_clear_error(ipc_dir):
    port = free_tcp_port()

    async def main():
        async with Transport() as t:
            t.channel(Endpoint("pull", f"tcp://127.0.0.1:{port}", bind=True))
            with pytest.raises(EndpointError, match="cannot bind"):
                t.channel(Endpoint("pull", f"tcp://127.0.0.1:{port}", bind=True))

    asyncio.run(main())
