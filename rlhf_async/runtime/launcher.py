"""Launchers start node processes; handles are shaped like `subprocess.Popen`.

`LocalLauncher` runs nodes on this host. Other hosts (ssh, Slurm) plug in by implementing
the `Launcher` protocol; the coordinator only uses launch / poll / wait / terminate / kill.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
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
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.popen.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.02)
        return rc

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


class LocalLauncher:
    """Starts `python -m rlhf_async.runtime --spec RUN_DIR/specs/NODE.json` on this host.

    stdout/stderr go to RUN_DIR/logs/NODE.log; each node gets its own session so a terminal
    Ctrl-C reaches only the coordinator, which then stops the nodes in order.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def launch(self, spec: NodeSpec, run_dir: Path) -> LocalProcess:
        (run_dir / "specs").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        spec_path = run_dir / "specs" / f"{spec.node_id}.json"
        spec.write(spec_path)
        log_path = run_dir / "logs" / f"{spec.node_id}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.num_threads), **spec.env}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [self.python, "-m", "rlhf_async.runtime", "--spec", str(spec_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return LocalProcess(popen, log_path)
