"""CURVE keys, the ZAP handler's counting, plaintext policy, private ipc files, size limits."""

import asyncio
import dataclasses
import os
import stat
import time
import tracemalloc

import msgpack
import pytest
import torch
import zmq

from rlhf_async.cli import main as cli_main
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.log import configure_logging
from rlhf_async.runtime import NodeSpec, SpecError
from rlhf_async.wire.local import free_tcp_port
from rlhf_async.wire.protocol import PROTOCOL_VERSION, Message, MessageTooLarge, decode, encode
from rlhf_async.wire.security import (
    Keyring,
    SecurityError,
    generate_keys,
    is_loopback,
    load_authorized,
)
from rlhf_async.wire.transport import Endpoint, Transport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _logs():
    configure_logging("error")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generated_keys_are_owner_only_and_load(tmp_path):
    d = tmp_path / "keys"
    generate_keys(d, extra_clients=("ops",))
    assert _mode(d) == 0o700
    for name in ("server", "client", "ops"):
        assert _mode(d / f"{name}.key_secret") == 0o600
    ring = Keyring.load(d)
    assert ring.server_secret and ring.client_secret and len(ring.server_public) == 40
    assert ring.authorized == {ring.client_public, Keyring.load(d, client="ops").client_public}
    assert ring.server_public not in ring.authorized  # the server key is not a client key


def test_existing_keys_are_not_overwritten_without_force(tmp_path):
    generate_keys(tmp_path / "k")
    before = Keyring.load(tmp_path / "k")
    with pytest.raises(SecurityError, match="--force"):
        generate_keys(tmp_path / "k")
    generate_keys(tmp_path / "k", force=True)
    assert Keyring.load(tmp_path / "k").server_public != before.server_public


def test_secret_readable_by_others_is_refused(tmp_path):
    generate_keys(tmp_path / "k")
    os.chmod(tmp_path / "k" / "client.key_secret", 0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        Keyring.load(tmp_path / "k")


def test_missing_and_malformed_keys_are_clear_errors(tmp_path):
    with pytest.raises(SecurityError, match="rlhf-async keys"):
        Keyring.load(tmp_path / "nowhere")
    generate_keys(tmp_path / "k")
    (tmp_path / "k" / "server.key_secret").write_text('curve\n    public-key = "short"\n')
    os.chmod(tmp_path / "k" / "server.key_secret", 0o600)
    with pytest.raises(SecurityError, match="z85"):
        Keyring.load(tmp_path / "k")


def test_authorized_file_of_z85_keys(tmp_path):
    pub, _ = zmq.curve_keypair()
    (tmp_path / "auth").write_text(f"# operators\n{pub.decode()}\n\n")
    assert load_authorized(tmp_path / "auth") == {pub}
    (tmp_path / "bad").write_text("not-a-key\n")
    with pytest.raises(SecurityError, match="line 1"):
        load_authorized(tmp_path / "bad")


@pytest.mark.parametrize("address,expected", [
    ("tcp://127.0.0.1:5", True), ("tcp://127.3.2.1:5", True), ("tcp://[::1]:5", True),
    ("tcp://localhost:5", True), ("tcp://10.0.0.1:5", False), ("tcp://*:5", False),
    ("tcp://0.0.0.0:5", False), ("tcp://node7:5", False),
])
def test_is_loopback(address, expected):
    assert is_loopback(address) is expected


def test_plaintext_tcp_beyond_loopback_needs_insecure():
    async def main():
        async with Transport() as t:
            with pytest.raises(SecurityError, match="rlhf-async keys"):
                t.channel(Endpoint("pull", f"tcp://0.0.0.0:{free_tcp_port()}", bind=True))
            with pytest.raises(SecurityError, match="insecure=True"):
                t.channel(Endpoint("push", "tcp://10.255.255.1:9", also=("tcp://127.0.0.1:9",)))
            t.channel(Endpoint("push", "tcp://127.0.0.1:9"))  # loopback stays allowed
        async with Transport(insecure=True) as t:
            t.channel(Endpoint("push", "tcp://10.255.255.1:9"))

    asyncio.run(main())


def test_curve_admits_authorised_key_and_counts_every_refusal(tmp_path):
    generate_keys(tmp_path / "k")
    generate_keys(tmp_path / "other")
    good, other = Keyring.load(tmp_path / "k"), Keyring.load(tmp_path / "other")
    unauthorised = dataclasses.replace(other, server_public=good.server_public)
    addr = f"tcp://127.0.0.1:{free_tcp_port()}"

    async def main():
        async with Transport(keys=good) as server, Transport(keys=good) as client, \
                Transport(keys=unauthorised) as wrong_key, Transport() as no_key:
            pull = server.channel(Endpoint("pull", addr, bind=True))
            await client.channel(Endpoint("push", addr)).send(Message("rollout", meta={"ok": 1}))
            assert (await pull.recv(timeout=10)).meta == {"ok": 1}
            for t in (wrong_key, no_key):
                await t.channel(Endpoint("push", addr)).send(Message("rollout"), timeout=2)
            deadline = asyncio.get_running_loop().time() + 10
            while (server.counters["auth.denied"] < 1
                   or server.counters["auth.handshake_failed"] < 1):
                assert asyncio.get_running_loop().time() < deadline, dict(server.counters)
                await asyncio.sleep(0.05)
            with pytest.raises(TimeoutError):
                await pull.recv(timeout=0.5)  # nothing from the refused peers got through
            c = server.counters
            assert c["auth.accepted"] == 1
            assert c["auth.refused"] == c["auth.denied"] + c["auth.handshake_failed"]
            assert c["rejected"] == 0

    asyncio.run(main())


def test_bound_ipc_socket_file_is_owner_only(tmp_path):
    path = tmp_path / "new" / "dir" / "q"

    async def main():
        async with Transport() as t:
            t.channel(Endpoint("pull", f"ipc://{path}", bind=True))
            assert _mode(path) == 0o600
            assert _mode(path.parent) == 0o700

    asyncio.run(main())


def test_huge_declared_size_is_refused_before_allocation():
    header = {"v": PROTOCOL_VERSION, "kind": "rollout", "id": "x", "parent": None, "src": "",
              "step": 0, "wv": 0, "ts": 0.0, "meta": {},
              "tensors": [["x", "float64", [2**40, 2**20], 1]]}
    frames = [msgpack.packb(header), b"\0" * 16]
    tracemalloc.start()
    try:
        with pytest.raises(MessageTooLarge):
            decode(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_oversized_frame_is_dropped_by_libzmq_and_the_socket_keeps_serving(tmp_path):
    addr = f"ipc://{tmp_path}/q"

    async def main():
        async with Transport(max_bytes=1 << 10) as server, Transport() as client:
            pull = server.channel(Endpoint("pull", addr, bind=True))
            big = client.channel(Endpoint("push", addr))  # MAXMSGSIZE is >= 1 MiB (headers)
            await big.send(Message("rollout", tensors={"x": torch.zeros(1 << 19)}), timeout=2)
            with pytest.raises(TimeoutError):
                await pull.recv(timeout=0.5)
            good = client.channel(Endpoint("push", addr))
            await good.send(Message("rollout", meta={"after": True}), timeout=2)
            assert (await pull.recv(timeout=10)).meta == {"after": True}

    asyncio.run(main())


def test_cli_keys_writes_keys_and_refuses_to_overwrite(tmp_path, capsys):
    assert cli_main(["keys", str(tmp_path / "k"), "--client", "ops"]) == 0
    assert "ops.key_secret" in capsys.readouterr().out
    assert cli_main(["keys", str(tmp_path / "k")]) == 1
    err = capsys.readouterr().err
    assert "already exist" in err and "Traceback" not in err
    assert cli_main(["keys", str(tmp_path / "k2"), "--client", "server"]) == 1


def test_node_spec_carries_keys_and_insecure(tmp_path):
    spec = NodeSpec("sink", "sink0", "nodes.demo_pipeline:sink", keys="/etc/rlhf/keys",
                    insecure=False)
    assert NodeSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match="insecure"):
        NodeSpec("sink", "sink0", "nodes.demo_pipeline:sink", insecure="yes")


def test_coordinator_hands_tcp_nodes_fresh_keys(tmp_path):
    tcp = NodeSpec("sink", "s", "m:f", endpoints={
        "in": Endpoint("pull", "tcp://127.0.0.1:9", bind=True)})
    ipc = NodeSpec("sink", "i", "m:f", endpoints={
        "in": Endpoint("pull", "ipc:///tmp/x", bind=True)})
    coord = Coordinator(tmp_path / "run")
    assert coord._with_keys(ipc).keys == ""
    keys = coord._with_keys(tcp).keys
    assert keys == str(tmp_path / "run" / "keys") and Keyring.load(keys).server_secret
    assert coord._with_keys(ipc).keys == keys  # once there are keys, every node gets them
    assert Coordinator(tmp_path / "r2", insecure=True)._with_keys(tcp).insecure


def test_fast_path_send_does_not_strand_a_task_waiting_to_receive(tmp_path):
    # Regression: a node stopped hearing the coordinator (and exited as orphaned) when a
    # heartbeat sent on the shadow socket consumed the fd edge its control loop waited on.
    addr = f"ipc://{tmp_path}/ctl"

    async def main():
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(addr)
        try:
            async with Transport() as t:
                dealer = t.channel(Endpoint("dealer", addr, identity="n"))
                await dealer.send(Message("heartbeat"))
                router.recv_multipart()
                waiting = asyncio.ensure_future(dealer.recv())
                await asyncio.sleep(0.02)
                router.send_multipart([b"n", *[bytes(f) for f in encode(Message("reply"))]])
                time.sleep(0.05)
                await dealer.send(Message("heartbeat"))
                assert (await asyncio.wait_for(waiting, 5)).kind == "reply"
        finally:
            router.close(0)
            ctx.term()

    asyncio.run(main())


def test_control_socket_is_a_private_ipc_file_even_for_a_long_run_dir(tmp_path):
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)

    async def main():
        async with Coordinator(long_dir) as coord:
            assert coord.control.startswith("ipc://")  # never falls back to tcp
            path = coord.control[len("ipc://"):]
            assert _mode(path) == 0o600 and _mode(os.path.dirname(path)) == 0o700
        assert not os.path.exists(os.path.dirname(path))

    asyncio.run(main())
