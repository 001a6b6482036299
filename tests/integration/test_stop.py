"""A stop (SIGTERM, or `rlhf-async stop`) in the middle of a run: the step in flight is
finished, a checkpoint is written even with run.checkpoint_every = 0, the job exits 0
naming the checkpoint and the resume command, and `resume` finishes the run with every
step's metrics and samples exactly once. Resuming a finished run returns at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlhf_async.cli.main import main

pytestmark = [pytest.mark.timeout(300)]

BASE = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "run.checkpoint_every=0", "placement.cpu_threads=1"]
# steps: enough that the stop lands mid-run however loaded the box (it is requested in
# milliseconds once step 3 is recorded; ~0.3 s a step on 2 idle cores). Interleaving stops like Flattening: the same rank loop
# (strategies/lockstep.py) and the same SIGTERM from `stop`.
STRATEGIES = {"flattening": ["placement.strategy=flattening", "placement.devices=2"],
              "separation": ["placement.strategy=separation", "placement.devices=2"]}
STEPS = {"flattening": 45, "separation": 55}


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlhf_async", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(path: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 200
    while len(_records(path)) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0][-3000:]


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_a_stop_checkpoints_and_resume_finishes_exactly_once(tmp_path, cache, strategy):
    """`rlhf-async stop`: the coordinator's stop for Separation, SIGTERM to the run's pid
    for a lock-step run."""
    run_dir = tmp_path / "r"
    steps = STEPS[strategy]
    over = [*BASE, *STRATEGIES[strategy], f"train.steps={steps}", "run.name=r",
            f"run.cache_dir={json.dumps(str(cache))}",
            f"run.output_dir={json.dumps(str(tmp_path))}"]
    proc = _cli("run", *over, start_new_session=True)
    _wait_for_steps(run_dir / "metrics.jsonl", proc, 3)
    # the `stop` command's own code, called here: a new interpreter takes seconds to start
    # (tens on a loaded box), in which the run could finish all its steps
    with ThreadPoolExecutor(1) as pool:  # off the main thread: main() leaves SIGTERM alone
        assert pool.submit(main, ["stop", "--run-dir", str(run_dir)]).result(30) == 0
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "continue with: rlhf-async resume" in out, out[-2000:]
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*"))
    assert ckpts, "no checkpoint on stop"
    step = int(ckpts[-1].name.split("-")[1])
    assert f"checkpoint of step {step}" in out
    assert [r["step"] for r in _records(run_dir / "metrics.jsonl")] == list(range(step))
    assert not (run_dir / "ctl.sock").exists()  # the stopped coordinator's control socket

    resume = _cli("resume", str(run_dir))
    out, _ = resume.communicate(timeout=240)
    assert resume.returncode == 0, out[-3000:]
    assert [r["step"] for r in _records(run_dir / "metrics.jsonl")] == list(range(steps))
    assert not (run_dir / "ctl.sock").exists()
    if strategy == "separation":  # the trainer's own log of what it trained
        counts = Counter(s for r in _records(run_dir / "trained_samples.jsonl")
                         for s in r["sample_ids"])
        assert set(counts) == set(range(steps * 8)) and set(counts.values()) == {1}

    again = _cli("resume", str(run_dir))
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and "already finished" in out, out[-2000:]


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_over(tmp_path, cache):
    from rlhf_async.config import load_config, to_dict
    from rlhf_async.job import resume_job

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    cfg = load_config(None, [*BASE, "train.steps=2", "placement.devices=1",
                             f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=r"])
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg)))
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # a step never checkpointed
    assert resume_job(run_dir) == 0
    assert [r["step"] for r in _records(run_dir / "metrics.jsonl")] == [0, 1]
    assert (run_dir / "policy" / "model.safetensors").exists()
    assert "final_hidden_score" in json.loads((run_dir / "summary.json").read_text())


def test_a_stop_before_rl_exits_0_and_resume_starts_at_step_0(tmp_path):
    run_dir = tmp_path / "r"
    over = [*BASE, "placement.devices=1", "train.steps=3", "sft.steps=100000", "run.name=r",
            f"run.cache_dir={json.dumps(str(tmp_path / 'c'))}",
            f"run.output_dir={json.dumps(str(tmp_path))}"]
    proc = _cli("run", *over)
    deadline = time.monotonic() + 60
    while not (run_dir / "config.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # in SFT now
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:]
    assert "no checkpoint yet (resume starts at step 0)" in out, out[-2000:]
    assert not (run_dir / "metrics.jsonl").exists()
