"""Directories for a job's ipc:// sockets, in the temp dir (unix socket paths are short).

A SIGKILLed job runs no cleanup, so its directory would stay forever. Each one is named
after the process that owns it (`rlhf-<pid>-<random>`), and making a new one first removes
those whose owner is gone: its pid no longer exists, or now belongs to a process started
after the directory was last written (a reused pid).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import psutil

from rlhf_async.log import get_logger

PREFIX = "rlhf-"
_NAME = re.compile(rf"{PREFIX}(\d+)-[A-Za-z0-9_]+")
log = get_logger(component="ipc-dir")


def make_ipc_dir() -> str:
    """A new 0700 directory owned by this process, after sweeping dead runs' leftovers."""
    sweep_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's socket directories under `root` (the temp dir) whose owner is
    gone; returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid() or \
                _owner_alive(int(m.group(1)), st.st_mtime):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.info("removed socket directories of dead runs", dirs=removed)
    return removed


def _owner_alive(pid: int, modified: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # the owner wrote the directory after it started; a later start is a reused pid
        return proc.create_time() <= modified + 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # cannot look: leave it
        return True
