"""The standards' environments and datasets trained as they are, end to end (`job.run`,
tiny model, 2 steps): a reasoning-gym dataset scored by its own scorer, under Flattening
and Separation."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from tests.text_model import make_text_model

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("adapters") / "model", positions=256)


def _run(model, tmp_path, name, *overrides):
    cfg = load_config(None, [
        f"model.path={json.dumps(str(model))}", "task.name=text", "generation.max_new_tokens=4",
        "train.steps=2", "train.prompts_per_step=4", "algo.group_size=2", "algo.name=grpo",
        "run.eval_prompts=4", "run.plot=false", "run.progress=false",
        f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}", *overrides])
    summary = job.run(cfg)
    return summary, read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.mark.parametrize("strategy", ["flattening", "separation"])
def test_a_reasoning_gym_dataset_trains_with_its_scorer(model, tmp_path, strategy):
    pytest.importorskip("reasoning_gym")
    more = ["placement.devices=2", "algo.max_staleness=0"] if strategy == "separation" else []
    summary, metrics = _run(model, tmp_path, strategy,
                            "task.prompts=reasoning_gym:basic_arithmetic",
                            "task.reasoning_gym={size = 32, seed = 1}",
                            f"placement.strategy={strategy}", *more)
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(0.0 <= m["hidden_score"] <= 1.0 for m in metrics)
    assert summary["final_hidden_score"] is not None
