"""On-policy distillation end to end: a teacher trained by RL (`rlhf-async run`'s policy/),
the SFT student distilled from it; Separation (the teacher on the scorer) and Interleaving
(on the reference's devices) follow Flattening's trajectory at max_staleness = 0."""

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
from rlhf_async.metrics import read_metrics
from tests.policies import assert_same_policy

pytestmark = [pytest.mark.timeout(300)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false"]


def _run(tmp_path, cache, name, *overrides):
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
                             *overrides])
    job.run(cfg)
    return read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, cache) -> str:
    """A teacher trained by RL: `rlhf-async run`'s policy/ (3 GRPO steps)."""
    out = tmp_path_factory.mktemp("teacher")
    _run(out, cache, "teacher", "algo.name=grpo", "train.steps=3")
    return json.dumps(str(out / "teacher" / "policy"))


def test_distillation_matches_flattening_in_every_strategy(tmp_path, cache, teacher,
                                                           one_thread):
    distil = ["algo.name=distill", f"teacher.path={teacher}", "train.steps=2"]
    flat = _run(tmp_path, cache, "flat", *distil)
    # the teacher on the scorer, on a device of its own (on CPU slots: the same one)
    sep = _run(tmp_path, cache, "sep", *distil, "placement.strategy=separation",
               "placement.devices=2", "algo.max_staleness=0", "placement.teacher=[1]")
    inter = _run(tmp_path, cache, "inter", *distil, "placement.strategy=interleaving",
                 "placement.devices=2", "train.prompts_per_step=8")
    keys = ["policy_loss", "reward", "teacher_reverse_kl", "entropy", "response_length",
            "advantage_abs"]
    assert len(flat) == len(sep) == len(inter) == 2
    for other in (sep, inter):
        for a, b in zip(flat, other, strict=True):
            for k in keys:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    assert all(r["teacher_reverse_kl"] != 0.0 for r in flat)  # the teacher is not the SFT
    # the trained students, not only their metrics: one trajectory (tests/policies.py says
    # why the key bias is left out). Separation trains on one rank as Flattening does;
    # Interleaving's two ranks sum gradients in another order, which Adam turns into up to a
    # fraction of lr (5e-4) on near-zero gradients: allowed lr / 10
    want = _policy(tmp_path, "flat")
    for name, atol in (("sep", 1e-5), ("inter", 5e-5)):
        assert_same_policy(want, _policy(tmp_path, name), atol=atol, label=name)


def _policy(tmp_path, name) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / name / "policy" / "model.safetensors"))


def _args(tmp_path, cache, name, teacher):
    return [*TINY, f"run.cache_dir={json.dumps(str(cache))}", "placement.cpu_threads=1",
            f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
            "algo.name=distill", f"teacher.path={teacher}", "train.steps=6",
            "run.checkpoint_every=2", "placement.strategy=separation", "placement.devices=2"]


def test_sigkill_then_resume_reloads_the_teacher(tmp_path, cache, teacher, one_thread):
    """The teacher is in no checkpoint: a resumed run reloads it from teacher.path and ends
    where an uninterrupted one does."""
    job.run(load_config(None, _args(tmp_path, cache, "whole", teacher)))
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "run",
                             *_args(tmp_path, cache, "killed", teacher)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    lines = lambda: metrics.read_text().splitlines() if metrics.exists() else []  # noqa: E731
    deadline = time.monotonic() + 240
    while len(lines()) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(children, timeout=30)
    assert len(lines()) < 6, "the run finished before the kill"
    rc = subprocess.run([sys.executable, "-m", "rlhf_async", "resume",
                         str(tmp_path / "killed")], capture_output=True, text=True, timeout=240)
    assert rc.returncode == 0, rc.stderr[-2000:]
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(metrics)
    assert [r["step"] for r in resumed] == list(range(6))
    for a, b in zip(whole, resumed, strict=True):
        assert a["teacher_reverse_kl"] == pytest.approx(b["teacher_reverse_kl"], rel=1e-4)
    w, r = _policy(tmp_path, "whole"), _policy(tmp_path, "killed")
    for k in w:
        torch.testing.assert_close(w[k], r[k], rtol=1e-5, atol=1e-6)
