"""Kill a whole job with SIGKILL mid-run, `rlhf-async resume` it: at max_staleness = 0 the
final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rlhf_async import job
from rlhf_async.config import load_config

pytestmark = [pytest.mark.timeout(300)]

BASE = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=8", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.checkpoint_every=2", "placement.cpu_threads=1"]
STRATEGIES = {"separation": ["placement.strategy=separation", "placement.devices=2"],
              "flattening": ["placement.strategy=flattening", "placement.devices=1"]}


def _overrides(tmp_path, cache, name, strategy):
    return BASE + STRATEGIES[strategy] + [f"run.cache_dir={json.dumps(str(cache))}",
                                          f"run.output_dir={json.dumps(str(tmp_path))}",
                                          f"run.name={name}"]


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("strategy", ["separation", "flattening"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, cache, strategy):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job.run(load_config(None, _overrides(tmp_path, cache, "whole", strategy)))
    finally:
        torch.set_num_threads(before)
    cmd = [sys.executable, "-m", "rlhf_async", "run", *_overrides(tmp_path, cache, "killed", strategy)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while len(_lines(metrics)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and anything in its group
    proc.wait()
    psutil.wait_procs(children, timeout=30)
    assert len(_lines(metrics)) < 8, "the run finished before the kill"

    rc = subprocess.run([sys.executable, "-m", "rlhf_async", "resume",
                         str(tmp_path / "killed")], capture_output=True, text=True, timeout=240)
    assert rc.returncode == 0, rc.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in _lines(metrics)]
    assert steps == list(range(8))  # records after the checkpoint were replaced, not doubled
    whole = load_file(str(tmp_path / "whole" / "policy" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "killed" / "policy" / "model.safetensors"))
    for k in whole:
        torch.testing.assert_close(whole[k], resumed[k], rtol=1e-5, atol=1e-6)


def test_resume_refuses_a_directory_without_a_run(tmp_path):
    rc = subprocess.run([sys.executable, "-m", "rlhf_async", "resume", str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert rc.returncode == 1
    assert "not a run directory" in rc.stderr and "Traceback" not in rc.stderr
