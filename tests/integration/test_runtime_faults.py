"""Failures with real processes: dead nodes are detected and named, restarts work, and no
process outlives its coordinator (SIGTERM, CLI stop, SIGKILL) or a silent coordinator."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from rlhf_async.control.coordinator import Coordinator, call_coordinator, read_coordinator_file
from rlhf_async.control.demo import address_maker, build_specs
from rlhf_async.runtime import NodeSpec
from rlhf_async.runtime.launcher import LocalLauncher
from rlhf_async.runtime.loop import run_loop
from rlhf_async.runtime.process import EXIT_FENCED
from rlhf_async.wire.protocol import Message
from rlhf_async.wire.transport import Endpoint, Transport

HEARTBEAT, TIME_TO_DEAD = 0.2, 2.0


async def _next_event(events, kind, timeout):
    deadline = time.monotonic() + timeout
    while True:
        event = await events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if event.kind == kind:
            return event


@pytest.mark.timeout(120)
def test_killed_and_frozen_nodes_are_declared_dead_by_name(tmp_path, ipc_dir):
    async def main():
        async with Coordinator(tmp_path / "run", heartbeat_s=HEARTBEAT,
                               time_to_dead=TIME_TO_DEAD) as coord:
            specs = build_specs(address_maker("ipc", ipc_dir), messages=10**7, floats=4, hwm=8)
            specs = [NodeSpec.from_dict({**s.to_dict(), "heartbeat_s": HEARTBEAT}) for s in specs]
            with coord.events() as events:
                await coord.launch(specs)
                os.kill(coord.nodes["transform0"].process.pid, signal.SIGKILL)
                dead = await _next_event(events, "node_dead", TIME_TO_DEAD + 2)
                assert dead.node_id == "transform0"
                assert "exited with code -9" in dead.payload["reason"]
                # A frozen process is alive but silent: only the heartbeat timeout catches it.
                frozen = coord.nodes["sink0"].process
                os.kill(frozen.pid, signal.SIGSTOP)
                dead = await _next_event(events, "node_dead", TIME_TO_DEAD + 3)
                assert dead.node_id == "sink0" and "no heartbeat" in dead.payload["reason"]
                assert await frozen.wait(timeout=5) is not None  # killed, not left behind
                assert coord.status()["nodes"]["sink0"]["state"] == "dead"

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_dead_node_is_restarted_up_to_the_limit(tmp_path, ipc_dir):
    async def main():
        async with Coordinator(tmp_path / "run", heartbeat_s=HEARTBEAT, time_to_dead=TIME_TO_DEAD,
                               restart_limit=1) as coord:
            specs = build_specs(address_maker("ipc", ipc_dir), messages=10**7, floats=4, hwm=8)
            with coord.events() as events:
                await coord.launch(specs)
                first_pid = coord.nodes["transform0"].process.pid
                os.kill(first_pid, signal.SIGKILL)
                dead = await _next_event(events, "node_dead", TIME_TO_DEAD + 2)
                assert dead.payload["will_restart"] is True
                await _next_event(events, "node_restarted", 5)
                await coord.wait_ready(["transform0"], timeout=60)
                status = await coord.command("transform0", "status")
                assert status["pid"] != first_pid
                assert coord.status()["nodes"]["transform0"]["restarts"] == 1
                os.kill(status["pid"], signal.SIGKILL)
                dead = await _next_event(events, "node_dead", TIME_TO_DEAD + 2)
                assert dead.payload["will_restart"] is False

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_frozen_node_is_restarted_and_its_old_incarnation_is_fenced_off(tmp_path, ipc_dir):
    """SIGSTOP: no heartbeats, so dead after time_to_dead, SIGKILLed while stopped and
    started again as incarnation 1. Whatever incarnation 0 would still send (a process that
    could not be killed: a host cut off, then back) is rejected and counted."""
    async def main():
        async with Coordinator(tmp_path / "run", heartbeat_s=HEARTBEAT, time_to_dead=TIME_TO_DEAD,
                               restart_limit=1) as coord:
            specs = build_specs(address_maker("ipc", ipc_dir), messages=10**7, floats=4, hwm=8)
            specs = [NodeSpec.from_dict({**s.to_dict(), "heartbeat_s": HEARTBEAT}) for s in specs]
            with coord.events() as events:
                await coord.launch(specs)
                frozen = coord.nodes["transform0"].process
                t0 = time.monotonic()
                os.kill(frozen.pid, signal.SIGSTOP)
                dead = await _next_event(events, "node_dead", TIME_TO_DEAD + 3)
                assert "no heartbeat" in dead.payload["reason"] and dead.payload["will_restart"]
                assert TIME_TO_DEAD - HEARTBEAT <= time.monotonic() - t0 < TIME_TO_DEAD + 3
                assert await frozen.wait(timeout=5) == -signal.SIGKILL  # killed while stopped
                await coord.wait_ready(["transform0"], timeout=60)
                assert coord.status()["nodes"]["transform0"]["incarnation"] == 1
                async with Transport() as t:
                    ghost = t.channel(Endpoint("dealer", coord.control, identity="transform0#0"))
                    await ghost.send(Message("heartbeat", source="transform0"))
                    await ghost.send(Message("event", source="transform0",
                                             meta={"name": "ghost", "payload": None}))
                    deadline = time.monotonic() + 10
                    while coord.counters.get("control.fenced", 0) < 2:
                        assert time.monotonic() < deadline, coord.counters
                        await asyncio.sleep(0.05)
                    assert (await ghost.recv(timeout=5)).kind == "fenced"  # not "heartbeat"
                seen, drained = [], time.monotonic() + 2.0  # events may never pause 0.2 s
                with contextlib.suppress(TimeoutError):
                    while time.monotonic() < drained:
                        seen.append((await events.get(timeout=0.2)).kind)
                assert "ghost" not in seen
                status = await coord.command("transform0", "status")  # the live one answers
                assert status["pid"] == coord.nodes["transform0"].process.pid != frozen.pid
                # a real process of incarnation 0 (its host back from a partition) is told
                # it is fenced at its first word and exits at once
                old = replace(coord.nodes["transform0"].spec, incarnation=0)
                zombie = LocalLauncher().launch(old, tmp_path / "zombie")
                assert await zombie.wait(timeout=60) == EXIT_FENCED
                assert coord.counters["control.fenced"] >= 3

    asyncio.run(main())


async def idle_node(node) -> None:
    await node.wait_stop()


@pytest.mark.timeout(120)
def test_nodes_on_the_coordinators_host_beat_without_a_message(tmp_path):
    """They stamp the shared board; the coordinator, read nothing on its socket for them,
    still finds them alive past several times `time_to_dead` (a coordinator that answered
    a message per beat spent most of its CPU on them at 100+ nodes)."""
    async def main():
        async with Coordinator(tmp_path / "run", heartbeat_s=HEARTBEAT,
                               time_to_dead=TIME_TO_DEAD) as coord:
            specs = [NodeSpec("worker", f"w{i}", f"{__name__}:idle_node") for i in range(3)]
            await coord.launch(specs)
            with coord.events() as events, contextlib.suppress(TimeoutError):
                event = await events.get(timeout=3 * TIME_TO_DEAD)
                raise AssertionError(f"no event expected, got {event}")
            assert {n["state"] for n in coord.status()["nodes"].values()} == {"ready"}
            assert coord.counters.get("control.heartbeats", 0) == 0
            assert all(n.spec.beats and n.spec.heartbeat_s == HEARTBEAT
                       for n in coord.nodes.values())

    asyncio.run(main())


async def hung_node(node) -> None:
    """A node program whose collective never returns while its event loop stays free."""
    await node.watchdog.run("collective", 1.0, asyncio.to_thread(time.sleep, 3600))


@pytest.mark.timeout(120)
def test_an_operation_past_its_deadline_gets_its_node_declared_dead(tmp_path):
    """The loop runs (it could beat), the work does not progress: the watchdog stops the
    heartbeats, the coordinator kills the node."""
    async def main():
        async with Coordinator(tmp_path / "run", heartbeat_s=HEARTBEAT,
                               time_to_dead=TIME_TO_DEAD) as coord:
            spec = NodeSpec("worker", "hung", f"{__name__}:hung_node", heartbeat_s=HEARTBEAT)
            with coord.events() as events:
                await coord.launch([spec])
                t0 = time.monotonic()
                dead = await _next_event(events, "node_dead", 1.0 + TIME_TO_DEAD + 10)
                assert "no heartbeat" in dead.payload["reason"]
                assert time.monotonic() - t0 >= TIME_TO_DEAD - HEARTBEAT
                assert await coord.nodes["hung"].process.wait(timeout=5) == -signal.SIGKILL
        log = (tmp_path / "run" / "logs" / "hung.log").read_text()
        assert '"operation_overdue"' in log and '"collective"' in log

    asyncio.run(main())


def _start_demo(run_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_async", "demo", "--messages", "100000000", "--floats", "4",
         "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            info = read_coordinator_file(run_dir)
            status = run_loop(call_coordinator(info["control"], "status", timeout=2))
            states = {n["state"] for n in status["nodes"].values()}
            if len(status["nodes"]) == 3 and states == {"ready"}:
                return proc, [n["pid"] for n in status["nodes"].values()]
        except Exception:  # not up yet: no file, no answer, or nodes still starting
            time.sleep(0.3)
            continue
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("demo did not come up")


def _assert_all_gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["sigterm", "cli_stop", "sigkill"])
def test_no_process_outlives_the_coordinator(how, tmp_path):
    run_dir = tmp_path / "run"
    proc, node_pids = _start_demo(run_dir)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "cli_stop":
        stop = subprocess.run([sys.executable, "-m", "rlhf_async", "stop", "--run-dir",
                               str(run_dir)], capture_output=True, text=True, timeout=60,
                              check=False)
        assert stop.returncode == 0, stop.stderr
    else:  # no cleanup code runs: the nodes must notice by themselves
        proc.kill()
    rc = proc.wait(timeout=60)
    assert rc == (-9 if how == "sigkill" else 130)
    _assert_all_gone(node_pids)
    if how != "sigkill":
        assert not (run_dir / "coordinator.json").exists()


@pytest.mark.timeout(60)
def test_node_exits_when_the_coordinator_goes_silent(tmp_path, ipc_dir):
    # A control endpoint that accepts connections but never answers (no PDEATHSIG here:
    # the test process is the parent and stays alive), so only the node's watchdog helps.
    spec = NodeSpec("transform", "t0", "nodes.demo_pipeline:transform", control=f"ipc://{ipc_dir}/c",
                    endpoints={"in": Endpoint("pull", f"ipc://{ipc_dir}/in", bind=True),
                               "out": Endpoint("push", f"ipc://{ipc_dir}/out")},
                    heartbeat_s=0.1, orphan_timeout_s=1.0)
    spec_path = tmp_path / "t0.json"
    spec_path.write_text(json.dumps(spec.to_dict()))
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(spec.control)
    try:
        node = subprocess.run([sys.executable, "-m", "rlhf_async.runtime", "--spec",
                               str(spec_path)], capture_output=True, text=True, timeout=40,
                              check=False)
        assert router.poll(0)  # it did register before giving up
    finally:
        router.close(0)
        ctx.term()
    assert node.returncode == 3, node.stderr[-2000:]
    assert "coordinator_lost" in node.stderr


@pytest.mark.timeout(60)
def test_bad_entry_point_fails_fast_naming_the_node(tmp_path):
    async def main():
        async with Coordinator(tmp_path / "run") as coord:
            bad = NodeSpec("worker", "w0", "nodes.demo_pipeline:no_such_function")
            with pytest.raises(Exception, match=r"node 'w0' exited with code 2 .*w0.log"):
                await coord.launch([bad])

    asyncio.run(main())
    assert "no_such_function" in (tmp_path / "run" / "logs" / "w0.log").read_text()
