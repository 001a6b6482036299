"""Colocated vLLM (Flattening, `generation.backend = vllm`): the rank's engine takes the
rank's trained weights in process after every step, so the behaviour log-probs it serves
are the trainer's own recompute at the next step's start (`mismatch/ratio_*` = 1, to the
float32 kernels' differences, ~1e-5 here) while the policy moves away from the SFT one
(kl > 0): an engine that kept serving older weights would be off by the step's change."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (tests/vllm need the vLLM venv)")

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics

pytestmark = [pytest.mark.timeout(600)]


def test_flattening_on_vllm_serves_the_trained_weights(tmp_path, cache) -> None:
    cfg = load_config(None, ["task.name=calculator", "model.hidden=128", "model.layers=1",
                             "model.heads=2", "sft.steps=30", "run.eval_prompts=16",
                             "train.prompts_per_step=8", "algo.group_size=2", "train.steps=3",
                             "run.plot=false", "run.progress=false", "generation.backend=vllm",
                             "train.lr=3e-3", f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=flat"])
    job.run(cfg)
    rows = read_metrics(tmp_path / "flat" / "metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert abs(r["mismatch/ratio_max"] - 1) < 1e-3, r
        assert abs(r["mismatch/ratio_mean"] - 1) < 1e-4, r
    assert rows[-1]["kl"] > 1e-3, "the policy served at step 2 is not the SFT one"
