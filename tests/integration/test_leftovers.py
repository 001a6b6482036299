"""A SIGKILLed Separation run leaves its private directories behind (its sockets, its nodes'
heartbeat board: no cleanup runs); the next start sweeps them."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf_async.runtime.ipc_dir import sweep_ipc_dirs

pytestmark = [pytest.mark.timeout(300)]


def test_a_killed_separation_runs_socket_directory_is_swept(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "rlhf_async", "run", "placement.strategy=separation",
           "placement.devices=2", "sft.steps=2", "reward_model.steps=2", "train.steps=1000",
           "run.eval_prompts=4", "run.progress=false", "run.plot=false", "run.name=killed",
           f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}",
           f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}"]
    job = subprocess.Popen(cmd, env={**os.environ, "TMPDIR": str(tmp)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (left := list(tmp.glob(f"rlhf-{job.pid}-*"))):
            assert job.poll() is None and time.monotonic() < deadline, "no socket directory"
            time.sleep(0.2)
    finally:
        job.send_signal(signal.SIGKILL)  # its nodes get SIGTERM (they die with it)
        job.wait()
    left = list(tmp.glob(f"rlhf-{job.pid}-*"))
    assert left and all(d.is_dir() for d in left)  # nothing cleaned up after a SIGKILL
    assert sorted(sweep_ipc_dirs(str(tmp))) == sorted(str(d) for d in left)
    assert not any(d.exists() for d in left)
