"""`runtime.node_start = fork`: a node forked from the fork server is the process a fresh
interpreter would be (its session, environment, working directory, threads, log), is
supervised the same way (a SIGKILL is exit code -9, and it restarts), the server outlives
a SIGTERM to the run's process group, and a change of PYTHONPATH since the server started
reaches the next node (the server starts anew)."""

import asyncio
import json
import multiprocessing.forkserver
import os
import signal
import time
from pathlib import Path

import pytest

from rlhf_async.control.coordinator import Coordinator
from rlhf_async.runtime import NodeSpec
from rlhf_async.runtime.launcher import LocalLauncher

pytestmark = [pytest.mark.timeout(120)]
REPO = str(Path(__file__).resolve().parents[2])


def _spec(out, **kw) -> NodeSpec:
    return NodeSpec("probe", "probe0", "tests.integration.node_probe:main",
                    params={"out": str(out)}, env={"PROBE": "yes"}, num_threads=2,
                    heartbeat_s=0.2, **kw)


async def _facts(path, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the node never wrote its facts"
        await asyncio.sleep(0.05)
    return json.loads(path.read_text())


def test_a_forked_node_is_what_a_fresh_interpreter_would_be(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "facts.json"

    async def main():
        async with Coordinator(tmp_path / "run", launcher=LocalLauncher(start="fork"),
                               heartbeat_s=0.2, time_to_dead=2.0, restart_limit=1) as coord:
            with coord.events():
                await coord.launch([_spec(out)])
                facts = await _facts(out)
                assert facts == {"pid": facts["pid"], "sid": facts["pid"], "cwd": str(tmp_path),
                                 "threads": 2, "probe": "yes", "omp": "2", "site": None,
                                 "flushes": True}
                first = coord.nodes["probe0"].process
                assert first.pid == facts["pid"] and first.poll() is None
                out.unlink()
                t0 = time.monotonic()
                os.kill(first.pid, signal.SIGKILL)
                assert await first.wait(timeout=10) == -9
                again = await _facts(out)
                assert again["pid"] != facts["pid"]
                # forked, not a new interpreter: the restart is quick even on a loaded box
                print(f"restart after SIGKILL: {time.monotonic() - t0:.2f} s")
        assert (tmp_path / "run" / "logs" / "probe0.log").read_text().count('"node_ready"') == 2

    asyncio.run(main())


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_node_computes_with_subnormals_as_its_spec_says(tmp_path, monkeypatch, start):
    """`placement.flush_denormal` reaches every node's worker threads, either way a node
    starts: on (the default) subnormal floats are zero, off they are IEEE's."""
    monkeypatch.chdir(tmp_path)

    async def main():
        async with Coordinator(tmp_path / "run", launcher=LocalLauncher(start=start),
                               heartbeat_s=0.2, time_to_dead=5.0, restart_limit=0) as coord:
            outs = {on: tmp_path / f"{on}.json" for on in (True, False)}
            await coord.launch([NodeSpec("probe", f"probe{on:d}", "tests.integration.node_probe:main",
                                         params={"out": str(out)}, flush_denormal=on,
                                         env={"PYTHONPATH": REPO})  # a new interpreter's
                                for on, out in outs.items()])
            assert {on: (await _facts(out))["flushes"] for on, out in outs.items()} == {
                True: True, False: False}

    asyncio.run(main())


def test_a_sigterm_to_the_runs_process_group_leaves_the_fork_server_serving(tmp_path,
                                                                           monkeypatch):
    """GNU timeout and the job daemon send SIGTERM to the run's whole process group, the
    fork server with it: the run stops gracefully, so the server must outlive it (its
    nodes' exit codes are read through it; its death would SIGTERM them)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "facts.json"

    async def main():
        async with Coordinator(tmp_path / "run", launcher=LocalLauncher(start="fork"),
                               heartbeat_s=0.2, time_to_dead=2.0, restart_limit=1) as coord:
            with coord.events():
                await coord.launch([_spec(out)])
                await _facts(out)
                server = multiprocessing.forkserver._forkserver._forkserver_pid
                os.kill(server, signal.SIGTERM)
                node = coord.nodes["probe0"].process
                node.terminate()  # the node's own stop: exit 0, as the server reports it
                assert await node.wait(timeout=30) == 0
                os.kill(server, 0)  # still there (ProcessLookupError otherwise)

    asyncio.run(main())


def test_a_new_pythonpath_starts_a_new_fork_server(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.site_mark = 'from-site'\n")
    out = tmp_path / "facts.json"

    async def run_once() -> dict:
        out.unlink(missing_ok=True)
        async with Coordinator(tmp_path / "run", launcher=LocalLauncher(start="fork")) as coord:
            await coord.launch([_spec(out)])
            return await _facts(out)

    assert asyncio.run(run_once())["site"] is None
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    # a new server: its interpreter ran the sitecustomize, as a fresh one would
    assert asyncio.run(run_once())["site"] == "from-site"
