"""A node's own processes (vLLM's engine core) die with it: killing a node, or finding it
dead, kills what is left of its process group."""

import os
import signal
import subprocess
import sys
import time

from rlhf_async.runtime.launcher import LocalProcess

# a "node" in a session of its own that starts a child of its own, prints its pid, waits
NODE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); print(c.pid, flush=True); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone (its parent reaps it)
        return f.read().split(") ")[1][0] != "Z"


def test_killing_a_dead_node_kills_the_processes_it_left():
    popen = subprocess.Popen([sys.executable, "-c", NODE], stdout=subprocess.PIPE,
                             start_new_session=True)
    assert popen.stdout is not None
    child = int(popen.stdout.readline())
    node = LocalProcess(popen, log_path=None)  # type: ignore[arg-type]  # no log here
    os.kill(popen.pid, signal.SIGKILL)  # as a fault would: the node only
    popen.wait()
    assert _alive(child)  # orphaned, in the dead node's group
    node.kill()  # what the supervisor does to a node it finds dead
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
