"""On-policy distillation end to end: a teacher trained by RL (`rlhf-async run`'s policy/),
the SFT student distilled from it; Separation (the teacher on the scorer) and Interleaving
(on the reference's devices) follow Flattening's trajectory at max_staleness = 0."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics

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


def test_distillation_matches_flattening_in_every_strategy(tmp_path, cache, one_thread):
    _run(tmp_path, cache, "teacher", "algo.name=grpo", "train.steps=3")
    teacher = json.dumps(str(tmp_path / "teacher" / "policy"))
    distil = ["algo.name=distill", f"teacher.path={teacher}", "train.steps=2"]
    flat = _run(tmp_path, cache, "flat", *distil)
    sep = _run(tmp_path, cache, "sep", *distil, "placement.strategy=separation",
               "placement.devices=2", "algo.max_staleness=0")
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
