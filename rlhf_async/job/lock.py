"""One job per run directory: `hold_run_dir(run_dir)` takes RUN_DIR/run.lock before the job
writes anything there and removes it when the job ends, also on error.

The lock is an exclusive `flock` on the file, which the kernel drops when its process dies
(SIGKILL included), so a lock left behind by a dead job is never mistaken for a live one
and two jobs starting at the same moment cannot both win. The file holds the holder's pid
and host for the refusal message. A leftover file (its job died before removing it) is
taken over with a warning when it names this host; one naming another host is refused,
since a shared file system may not carry the other host's lock here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_async.log import get_logger

LOCK_FILE = "run.lock"
log = get_logger(component="run-lock")


class RunLockError(Exception):
    """The run directory is in use by another job, or its lock cannot be taken."""


@contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[Path]:
    """Hold RUN_DIR (made if missing) for one job; RunLockError naming the holder's pid and
    host when another job holds it."""
    fd = _acquire(run_dir)
    try:
        yield run_dir
    finally:
        (run_dir / LOCK_FILE).unlink(missing_ok=True)  # before the flock goes: see _acquire
        os.close(fd)


def check_free(run_dir: Path) -> None:
    """RunLockError naming the holder when another job holds RUN_DIR (made if missing);
    the lock is taken and given back at once, for a job whose ranks take it themselves."""
    with hold_run_dir(run_dir):
        return


def live_holder(run_dir: Path) -> int | None:
    """The pid of the job holding RUN_DIR on this host, if it is alive (`rlhf-async stop`
    signals it when the job has no coordinator: Flattening, Interleaving)."""
    try:
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid


def _acquire(run_dir: Path) -> int:
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise RunLockError(_busy(run_dir, holder)) from None
            if _is_current(fd, path):
                break
            os.close(fd)  # a holder that just ended unlinked the file we opened: again
    except OSError as e:
        raise RunLockError(f"cannot take the lock {path}: {e.strerror}") from None
    try:
        _take_over(fd, path, _read(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_current(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _take_over(fd: int, path: Path, previous: dict[str, Any]) -> None:
    """Write our pid and host into the locked file, after checking what a dead job left."""
    host = socket.gethostname()
    if previous and previous.get("host") != host:
        raise RunLockError(
            f"{path} names pid {previous.get('pid')} on host {previous.get('host')}, which "
            f"cannot be checked from {host}; if that run has ended, delete {path}")
    if previous:
        log.warning("taking over the lock of a run that is gone", path=str(path),
                    pid=previous.get("pid"), host=previous.get("host"),
                    since=previous.get("since"))
    data = json.dumps({"pid": os.getpid(), "host": host,
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read(fd: int) -> dict[str, Any]:
    """The holder's record; {} for an empty file, a marker for an unreadable one."""
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"pid": "?", "host": socket.gethostname()}


def _busy(run_dir: Path, holder: dict[str, Any]) -> str:
    who = (f"pid {holder.get('pid')} on host {holder.get('host')} (since "
           f"{holder.get('since')})" if holder else "a job starting this moment")
    return (f"{run_dir} is in use by another run: {who}; wait for it to end or stop it "
            f"(`rlhf-async stop --run-dir {run_dir}`), or use another run directory "
            "(run.name)")
