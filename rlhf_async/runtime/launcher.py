"""Launchers start node processes; handles are shaped like `subprocess.Popen`.

`LocalLauncher` runs nodes on this host, `RayLauncher` (ray_launcher.py) on a Ray cluster.
The coordinator only uses
launch / poll / wait / terminate / kill.

A local node starts one of two ways (`runtime.node_start`):

- ``fork`` (the default on Linux): forked from a server process that imported torch,
  transformers and the node programs its launcher was handed (`preload`) once
  (multiprocessing's forkserver, started on the first launch and kept for the
  coordinator's life). A node then starts, or restarts after
  a death, in a fraction of a second instead of the several seconds those imports take
  per process. The server never runs a torch op, so no thread pool or device is inherited;
  each node sets its own threads (`NodeSpec.num_threads`) and environment.
- ``exec``: a fresh interpreter per node (`python -m rlhf_async.runtime --spec ...`), for a
  node program whose imports must see its own environment, or a platform without fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from rlhf_async.runtime.process import leave, main
from rlhf_async.runtime.spec import NodeSpec

NODE_STARTS = ("fork", "exec")
# what the fork server imports once, before it forks any node (modeling.warm: and a first
# model load); a strategy adds its node programs (`Strategy.fork_preload`)
PRELOAD = ("rlhf_async.runtime.fork_signals", "torch", "transformers",
           "rlhf_async.runtime.process", "rlhf_async.modeling.warm")


class NodeProcess(Protocol):
    """A node's process. One may also have a `sentinel`: a descriptor readable once it has
    ended (a forked node's), which the supervisor watches instead of polling."""

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


def kill_group(pid: int | None) -> None:
    """SIGKILL what is left of a node's process group: the processes it started (a generation
    engine's core and workers) outlive a node killed by a signal. A node leads its own
    session, so the group's id is its pid, which the kernel does not hand out again while
    any process of the group lives: this reaches the node's processes only (called when
    the node is killed or found dead, before its pid could be reused)."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


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
        kill_group(self.pid)


class ForkedProcess:
    """A node forked from the fork server (`fork_node`): the same handle as `LocalProcess`;
    the server reports its exit code (a signal's as -signum, as Popen does)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, log_path: Path) -> None:
        self.process, self.log_path = process, log_path
        self.pid: int | None = process.pid
        self.sentinel: int = process.sentinel  # readable once the node has ended
        self._rc: int | None = None

    def poll(self) -> int | None:
        # a zero-timeout poll of the sentinel first: `exitcode` builds a selector per call,
        # and the supervisor polls every node twice a second
        if self._rc is None:
            ready = select.poll()
            ready.register(self.sentinel, select.POLLIN)
            if ready.poll(0):
                self._rc = self.process.exitcode
        return self._rc

    async def wait(self, timeout: float | None = None) -> int | None:
        """Exit code, or None if still running after `timeout` seconds."""
        return await wait_polling(self.poll, timeout, 0.02)

    def terminate(self) -> None:
        if self.poll() is None:
            self.process.terminate()

    def kill(self) -> None:
        if self.poll() is None:
            self.process.kill()
        kill_group(self.pid)


def write_spec(spec: NodeSpec, run_dir: Path) -> Path:
    """RUN_DIR/specs/NODE.json: what the node process reads first."""
    (run_dir / "specs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "specs" / f"{spec.node_id}.json"
    spec.write(spec_path)
    return spec_path


def node_log(spec: NodeSpec, run_dir: Path) -> Path:
    """RUN_DIR/logs/NODE.log, the node's stdout and stderr."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return run_dir / "logs" / f"{spec.node_id}.log"


def last_log_line(path: Path | str, limit: int = 300) -> str:
    """The last non-empty line of a node's log (a crash's exception, for one), cut to
    `limit` characters; "" when there is none or the log cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))  # a traceback's end, not the log
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in tail.splitlines() if x.strip()]
    return lines[-1][:limit] if lines else ""


def node_env(spec: NodeSpec, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The node's environment: ours (or `env`), its thread count, its spec's variables."""
    return {**(os.environ if env is None else env), "OMP_NUM_THREADS": str(spec.num_threads),
            **spec.env}


def start_node(spec: NodeSpec, run_dir: Path, python: str = sys.executable,
               env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `python -m rlhf_async.runtime --spec RUN_DIR/specs/NODE.json` on this host.

    stdout/stderr go to RUN_DIR/logs/NODE.log; the node gets its own session so a terminal
    Ctrl-C reaches only the coordinator, which then stops the nodes in order. The Ray
    launcher runs nodes with this inside its actor, on the actor's host.
    """
    spec_path = write_spec(spec, run_dir)
    return start_process([python, "-m", "rlhf_async.runtime", "--spec", str(spec_path)],
                         spec, run_dir, env)


def fork_node(spec: NodeSpec, run_dir: Path, preload: Sequence[str] = ()) -> ForkedProcess:
    """`start_node`, forked from the fork server (that imported `preload` too): the same log,
    session, environment, working directory and parent-death signal (the server's death: it
    exits with its coordinator)."""
    spec_path, log_path = write_spec(spec, run_dir), node_log(spec, run_dir)
    ctx = fork_server(preload)
    process = ctx.Process(target=_forked_node, name=spec.node_id, daemon=True,
                          args=(str(spec_path), str(log_path), node_env(spec), os.getcwd()))
    process.start()
    return ForkedProcess(process, log_path)


_server_started_with: tuple[object, ...] | None = None
_server_preload: tuple[str, ...] = ()


def fork_server(preload: Sequence[str] = ()) -> multiprocessing.context.ForkServerContext:
    """The fork server's context, its server importing `PRELOAD` and `preload` (a strategy's
    node programs). What an interpreter reads as it starts (PYTHON* and LD_* variables: a
    sitecustomize on PYTHONPATH, a preloaded library) and `sys.path` are the server's, so a
    change of them since it started (a second job of one process), or a module to preload
    that it did not, starts a new server; every other variable reaches a node when it is
    forked."""
    global _server_started_with, _server_preload
    missing = tuple(m for m in preload if m not in _server_preload)
    now = (tuple(sys.path), tuple(sorted((k, v) for k, v in os.environ.items()
                                         if k.startswith(("PYTHON", "LD_")))))
    if _server_started_with is not None and (_server_started_with != now or missing):
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    _server_started_with, _server_preload = now, _server_preload + missing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_server_preload])
    return ctx


def warm_fork_server(preload: Sequence[str] = ()) -> None:
    """Start the fork server now, importing `preload` too: it imports in the background
    while the job prepares (SFT, reward model), and the nodes launched later find it
    ready."""
    if can_fork():
        fork_server(preload)
        multiprocessing.forkserver.ensure_running()


def ready_fork_server(preload: Sequence[str] = ()) -> None:
    """`warm_fork_server`, and wait until its imports are done (its first child is forked
    once they are): for a benchmark whose clock must not hold them."""
    if can_fork():
        child = fork_server(preload).Process(target=int)
        child.start()
        child.join()


def can_fork() -> bool:
    """Whether this platform has the fork server (Linux and macOS do, Windows does not)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def adopt(env: Mapping[str, str], cwd: str) -> None:
    """In a process forked from the fork server: take the launching process's environment
    and working directory (the server has those of its own start)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _forked_node(spec_path: str, log_path: str, env: dict[str, str], cwd: str) -> None:
    """The node, in the forked child: become what `start_node`'s command line would be."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's is ignored (fork_signals)
    os.setsid()
    if sys.platform == "linux":
        _die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    adopt(env, cwd)
    # daemonic to the coordinator (ended at its exit), a normal process to itself: a node may
    # start processes of its own (a generation engine's workers)
    multiprocessing.current_process().daemon = False
    leave(main(["--spec", spec_path]))


def start_process(argv: list[str], spec: NodeSpec, run_dir: Path,
                  env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """Start `argv` as node `spec` (its env and threads; its log RUN_DIR/logs/NODE.log, its
    own session, dying with its parent): a node program (`start_node`), or a command such as
    one rank of a lock-step job on Ray (`rlhf-async run` with RANK, WORLD_SIZE, ... in env)."""
    log_path = node_log(spec, run_dir)
    env = node_env(spec, env)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return popen, log_path


class LocalLauncher:
    """Starts each node on this host: as a fresh interpreter (`start_node`), or with
    `start="fork"` forked from the fork server (`fork_node`; a Separation run's nodes, by
    `runtime.node_start`), unless `python` is another interpreter or there is no fork.
    `preload`: the modules of the node programs it will fork (the server imports them once)."""

    def __init__(self, python: str = sys.executable, start: str = "exec",
                 preload: Sequence[str] = ()) -> None:
        if start not in NODE_STARTS:
            raise ValueError(f"node start {start!r}: accepted: {', '.join(NODE_STARTS)}")
        self.python, self.preload = python, tuple(preload)
        self.fork = start == "fork" and python == sys.executable and can_fork()
        self.same_host = True  # its nodes beat into the coordinator's board (runtime/beats.py)

    def launch(self, spec: NodeSpec, run_dir: Path) -> LocalProcess | ForkedProcess:
        if self.fork:
            return fork_node(spec, run_dir, self.preload)
        return LocalProcess(*start_node(spec, run_dir, self.python))
