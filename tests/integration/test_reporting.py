"""run.report_to = ["tensorboard"]: a run's metrics in TensorBoard event files beside
metrics.jsonl, one scalar per metric and step (read back with TensorBoard's own reader)."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
pytestmark = [pytest.mark.timeout(300)]


def test_tensorboard_gets_every_step_of_a_run(tmp_path, one_thread):
    """The reporter follows metrics.jsonl, whichever strategy writes it: Flattening here
    (in-process, the quickest); the same file under Separation comes from the coordinator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [
        "model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=3", "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "run.progress=false", 'run.report_to=["tensorboard"]', f"run.cache_dir={json.dumps(str(tmp_path / 'c'))}",
        f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=tb"])
    job.run(cfg)
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    records = read_metrics(tmp_path / "tb" / "metrics.jsonl")
    for key in ("reward", "policy_loss", "kl", "samples_per_s"):
        points = events.Scalars(key)
        assert [p.step for p in points] == [0, 1, 2], key
        assert [p.value for p in points] == pytest.approx([r[key] for r in records]), key
