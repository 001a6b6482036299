"""App-level commands and events between the coordinator and a real node process."""

import asyncio

import pytest

from rlhf_async.control.coordinator import CommandError, Coordinator
from rlhf_async.runtime import Node, NodeSpec
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.transport import Endpoint, Transport, ipc_address


async def echo_node(node: Node) -> None:
    """Node program used by these tests (imported by the node process)."""
    async def slow(payload):
        await asyncio.sleep(0.05)
        return {"slow": payload}

    def boom(_):
        raise RuntimeError("handler exploded")

    node.on_command("echo", lambda payload: {"echo": payload, "node": node.node_id})
    node.on_command("slow", slow)
    node.on_command("boom", boom)
    node.on_command("unencodable", lambda _: object())
    node.info["threads"] = __import__("torch").get_num_threads()
    await node.emit("hello", {"params": node.params}, step=3, weight_version=7)
    await node.wait_stop()


@pytest.mark.timeout(60)
def test_commands_and_events_roundtrip(tmp_path):
    spec = NodeSpec("echo", "echo0", "tests.integration.test_runtime_commands:echo_node",
                    params={"k": [1, 2]}, num_threads=2)

    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            with coord.events() as events:
                await coord.launch([spec])
                while (event := await events.get(timeout=30)).kind != "hello":
                    pass
            assert event.node_id == "echo0" and event.payload == {"params": {"k": [1, 2]}}
            assert (event.step, event.weight_version) == (3, 7)
            assert await coord.command("echo0", "echo", {"x": 1.5}) == \
                {"echo": {"x": 1.5}, "node": "echo0"}
            results = await asyncio.gather(*(coord.command("echo0", "slow", i) for i in range(5)))
            assert results == [{"slow": i} for i in range(5)]  # concurrent, matched by id
            with pytest.raises(CommandError, match="RuntimeError: handler exploded"):
                await coord.command("echo0", "boom")
            with pytest.raises(CommandError, match="unknown command 'nope'; known: .*echo"):
                await coord.command("echo0", "nope")
            with pytest.raises(CommandError, match="not msgpack-able"):
                await coord.command("echo0", "unencodable")
            status = await coord.command("echo0", "status")
            assert status["info"] == {"threads": 2} and status["role"] == "echo"
            assert await coord.command("echo0", "echo", "still alive") == \
                {"echo": "still alive", "node": "echo0"}
            await coord.stop()
            assert coord.nodes["echo0"].process.poll() == 0

    asyncio.run(main())


async def pusher_node(node: Node) -> None:
    """Pushes one message on its `out` endpoint per `push` command."""
    out = node.socket("out")

    async def push(payload):
        await out.send(Message("rollout", meta={"n": payload}), timeout=5)
        return out.endpoint.address

    node.on_command("push", push)
    await node.wait_stop()


@pytest.mark.timeout(60)
def test_a_moved_peer_is_followed_and_what_queued_for_its_old_address_is_dropped(tmp_path):
    """A peer bound at `old` moved to `new` (restarted on another host): the coordinator
    re-addresses every spec and tells the running node connecting there to follow; what
    it had queued for the old address is dropped instead of reaching whoever binds there
    later."""
    old, new = (ipc_address(str(tmp_path), n) for n in ("old", "new"))
    spec = NodeSpec("pusher", "pusher0", "tests.integration.test_runtime_commands:pusher_node",
                    endpoints={"out": Endpoint("push", old, hwm=4)})

    async def main():
        async with Coordinator(tmp_path / "run") as coord, Transport() as t:
            await coord.launch([spec])
            assert await coord.command("pusher0", "push", 1) == old  # queued: nobody at old
            coord.readdress("scorer0", {old: new})
            assert coord.nodes["pusher0"].spec.endpoints["out"].address == new
            await coord.moves_followed()
            at_new = t.channel(Endpoint("pull", new, bind=True))
            assert await coord.command("pusher0", "push", 2) == new
            assert (await at_new.recv(timeout=10)).meta == {"n": 2}
            at_old = t.channel(Endpoint("pull", old, bind=True))
            with pytest.raises(TimeoutError):
                await at_old.recv(timeout=1.0)  # message 1 left with the old pipe
            with pytest.raises(CommandError, match="readdress: Expected `object`, got `array`"):
                await coord.command("pusher0", "readdress", ["not", "a", "mapping"])

    asyncio.run(main())
