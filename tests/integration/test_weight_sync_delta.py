"""Separation with delta weight updates trains the same trajectory as with full updates at
max_staleness = 0 (deltas rebuild the weights bit for bit), and sends fewer bytes."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics

pytestmark = [pytest.mark.timeout(300)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
        "run.progress=false", "algo.name=grpo", "placement.strategy=separation",
        "placement.devices=3", "algo.max_staleness=0"]


def _run(tmp_path, cache, name, delta):
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
                             f"weight_sync.delta={delta}"])
    job.run(cfg)
    return read_metrics(tmp_path / name / "metrics.jsonl")


def test_delta_updates_train_the_same_trajectory(tmp_path, cache, one_thread):
    full = _run(tmp_path, cache, "full", "off")
    delta = _run(tmp_path, cache, "delta", "on")
    assert len(full) == len(delta) == 3
    for a, b in zip(full, delta, strict=True):
        for k in ["policy_loss", "reward", "kl", "entropy", "response_length"]:
            assert a[k] == b[k], (a["step"], k)
    assert all(r["weight_sync/delta_ratio"] == 1.0 for r in full)
    # the first update after start is full; then only changed values travel
    assert [r["weight_sync/delta_ratio"] < 1.0 for r in delta] == [False, True, True]
    assert delta[-1]["weight_sync/full_fallbacks"] == 0
    assert delta[-1]["weight_sync_bytes"] < full[-1]["weight_sync_bytes"]
