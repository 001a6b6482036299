"""runtime/cpu.py: a process's torch threads and its subnormal floats, in threads it starts."""

import subprocess
import sys

# in a fresh interpreter: the setting is the calling thread's, and pytest's must stay as it is
PROBE = """
import threading
import torch
from rlhf_async.runtime.cpu import flushes_denormal, set_cpu_compute

def in_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(flushes_denormal()))
    t.start()
    t.join()
    return seen[0]

before = flushes_denormal()
set_cpu_compute(1, True)
on = (flushes_denormal(), in_thread(), torch.get_num_threads())
set_cpu_compute(1, False)
print(before, *on, flushes_denormal(), in_thread())
"""


def test_flushing_reaches_the_threads_started_after_it_and_turns_off():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    # IEEE at start; on: here, in a new thread, one torch thread; off again: both IEEE
    assert out == ["False", "True", "True", "1", "False", "False"]
