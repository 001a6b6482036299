"""Launchers start node processes; handles are shaped like `subprocess.Popen`.

`LocalLauncher` runs nodes on this host, `RayLauncher` (ray_launcher.py) on a Ray cluster.
The coordinator only uses
launch / poll / wait / terminate / kill.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from rlhf_async.runtime.spec import NodeSpec


class NodeProcess(Protocol):
    pid: int | None

    def poll(self) -> int | None: ...

    async def wait(self, timeout: float | None = None) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    def launch(self, spec: NodeSpec, run_dir: Path) -> NodeProcess: ...


async def wait_polling(poll: Callable[[], int | None], timeout: float | None,
                       every: float) -> int | None:
    """`poll()` every `every` seconds until it gives an exit code (returned), or None once
    `timeout` seconds have passed: the `wait` of every NodeProcess."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (rc := poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            return None
        await asyncio.sleep(every)
    return rc


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the node when the coordinator dies, even by SIGKILL.
    # It fires when the forking *thread* exits, so launch only from the event-loop thread.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalProcess:
    """A node running on this host (a thin async wrapper over Popen)."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.popen, self.log_path = popen, log_path
        self.pid: int | None = popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    async def wait(self, timeout: float | None = None) -> int | None:
        """Exit code, or None if still running after `timeout` seconds."""
        return await wait_polling(self.popen.poll, timeout, 0.02)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


def start_node(spec: NodeSpec, run_dir: Path, python: str = sys.executable,
               env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `python -m rlhf_async.runtime --spec RUN_DIR/specs/NODE.json` on this host.

    stdout/stderr go to RUN_DIR/logs/NODE.log; the node gets its own session so a terminal
    Ctrl-C reaches only the coordinator, which then stops the nodes in order. Every launcher
    runs nodes with this (the Ray one inside its actor, on the actor's host).
    """
    (run_dir / "specs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "specs" / f"{spec.node_id}.json"
    spec.write(spec_path)
    return start_process([python, "-m", "rlhf_async.runtime", "--spec", str(spec_path)],
                         spec, run_dir, env)


def start_process(argv: list[str], spec: NodeSpec, run_dir: Path,
                  env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `argv` as node `spec` (its env and threads; its log RUN_DIR/logs/NODE.log, its
    own session, dying with its parent): a node program (`start_node`), or a command such as
    one rank of a lock-step job on Ray (`rlhf-async run` with RANK, WORLD_SIZE, ... in env)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "logs" / f"{spec.node_id}.log"
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": str(spec.num_threads),
           **spec.env}
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return popen, log_path


class LocalLauncher:
    """Starts each node on this host (`start_node`)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def launch(self, spec: NodeSpec, run_dir: Path) -> LocalProcess:
        return LocalProcess(*start_node(spec, run_dir, self.python))
