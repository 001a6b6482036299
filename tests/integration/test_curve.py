"""Real node processes over tcp://127.0.0.1 with CURVE: the pipeline (and its control plane)
works with the right keys; peers with no key or a wrong key are refused and counted, and
nothing they send reaches a node."""

import asyncio
import dataclasses

import pytest
import torch

from nodes.demo_pipeline import DEMO
from rlhf_async.cli import main as cli_main
from rlhf_async.control.coordinator import Coordinator, call_coordinator
from rlhf_async.control.demo import address_maker, build_specs
from rlhf_async.log import configure_logging
from rlhf_async.wire.local import free_tcp_port
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.security import Keyring, generate_keys
from rlhf_async.wire.transport import Endpoint, Transport

MESSAGES = 2000


@pytest.fixture(autouse=True)
def _logs():
    configure_logging("error")


async def _attack(transports: list[Transport], addresses: list[str]) -> None:
    """Valid demo messages a leak would make the nodes count (or crash on). A send may
    find no pipe to queue on: once the server refuses the handshake, libzmq drops the
    connection's queue, and until the next reconnect there is nowhere to put a message.
    That is the refusal itself, so a timed-out send moves on to the next address; the
    auth counters below check that each handshake was tried and refused."""
    for t in transports:
        for address in addresses:
            chan = t.channel(Endpoint("push", address, hwm=4))
            for seq in range(3):
                try:
                    await chan.send(Message(DEMO, meta={"producer": "evil", "seq": seq},
                                            tensors={"x": torch.zeros(16)}), timeout=1)
                except TimeoutError:
                    break


async def _wait_counters(coord: Coordinator, node: str, keys: tuple[str, ...]) -> dict:
    for _ in range(200):
        counters = (await coord.command(node, "status"))["counters"]
        if all(counters.get(k, 0) >= 1 for k in keys):
            return counters
        await asyncio.sleep(0.1)
    raise AssertionError(f"{node} never counted {keys}: {counters}")


@pytest.mark.timeout(120)
def test_curve_pipeline_refuses_and_counts_peers_without_the_right_key(tmp_path):
    keys = tmp_path / "keys"
    assert cli_main(["keys", str(keys)]) == 0
    generate_keys(tmp_path / "other")
    other = Keyring.load(tmp_path / "other")
    # a client that knows the server key but holds a key nobody authorised
    wrong = dataclasses.replace(other, server_public=Keyring.load(keys).server_public)
    control = f"tcp://127.0.0.1:{free_tcp_port()}"
    run = tmp_path / "run"

    async def main():
        async with Coordinator(run, keys=keys, control=control) as coord, \
                Transport(keys=wrong) as wrong_key, Transport() as no_key:
            specs = build_specs(address_maker("tcp", ""), messages=MESSAGES, floats=16,
                                hwm=32, progress_every=MESSAGES)
            data = [s.endpoints["in"].address for s in specs if "in" in s.endpoints]
            with coord.events() as events:
                await coord.launch(specs)
                await _attack([wrong_key, no_key], [*data, control])
                while (event := await events.get(timeout=60)).kind != "done":
                    assert event.kind != "node_dead", event
            assert event.payload["received"] == MESSAGES
            assert event.payload["out_of_order"] == 0 and event.payload["bad_values"] == 0
            for node in ("transform0", "sink0"):
                counters = await _wait_counters(coord, node,
                                                ("auth.denied", "auth.handshake_failed"))
                assert counters.get("rejected", 0) == 0, counters  # nothing got in to reject
            transform = (await coord.command("transform0", "status"))["counters"]
            sink = (await coord.command("sink0", "status"))["counters"]
            assert transform["forwarded"] == MESSAGES and sink["received"] == MESSAGES
            # the control plane is CURVE too: the keyed client gets an answer, others do not
            status = await call_coordinator(control, "status", keys=keys, timeout=10)
            assert set(status["nodes"]) == {"source0", "transform0", "sink0"}
            with pytest.raises(TimeoutError):
                await call_coordinator(control, "status", timeout=1)
            assert coord.counters.get("auth.refused", 0) >= 1
            assert coord.counters.get("control.unknown_peer", 0) == 0
            # the CLI finds the keys through RUN_DIR/coordinator.json
            assert await asyncio.to_thread(cli_main, ["status", "--run-dir", str(run)]) == 0

    asyncio.run(main())
