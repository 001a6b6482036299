"""Socket directories carry their owner's pid; those of dead runs (SIGKILL: no cleanup)
are swept when the next one is made."""

import os
import subprocess
import sys
import tempfile
import time

import pytest

from rlhf_async.runtime.ipc_dir import make_ipc_dir, sweep_ipc_dirs

MAKE = ("import time; from rlhf_async.runtime.ipc_dir import make_ipc_dir\n"
        "print(make_ipc_dir(), flush=True)\ntime.sleep(120)\n")


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def test_a_killed_runs_socket_directory_is_removed_at_the_next_start(tmp_root):
    proc = subprocess.Popen([sys.executable, "-c", MAKE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    theirs = proc.stdout.readline().strip()
    assert os.path.basename(theirs).startswith(f"rlhf-{proc.pid}-")
    (tmp_root / theirs / "scored").write_text("")  # where a socket would be
    mine = make_ipc_dir()  # the owner is alive: kept
    assert os.path.isdir(theirs) and os.path.basename(mine).startswith(f"rlhf-{os.getpid()}-")
    proc.kill()
    proc.wait()
    again = make_ipc_dir()
    assert not os.path.exists(theirs) and os.path.isdir(mine) and os.path.isdir(again)


def test_only_dead_owners_directories_go(tmp_root):
    live = tmp_root / f"rlhf-{os.getpid()}-abc_1"
    reused = tmp_root / f"rlhf-{os.getpid()}-old"  # written before this process started
    other = tmp_root / "rlhf-ctl-x1"  # not one of ours
    for d in (live, reused, other):
        d.mkdir()
    past = time.time() - 10 * 24 * 3600
    os.utime(reused, (past, past))
    (tmp_root / "rlhf-1-file").write_text("")  # a file, not a directory
    assert sweep_ipc_dirs() == [str(reused)]
    assert live.is_dir() and other.is_dir() and (tmp_root / "rlhf-1-file").exists()
