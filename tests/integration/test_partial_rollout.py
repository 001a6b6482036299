"""Separation with partial rollouts (generation.partial_rollout): weights swapped between two
decode steps of a running chunk, chunk by chunk and with continuous batching (the next
chunk's rows decoding beside the running one's). One small run each, its generator
SIGKILLed mid-run: every prompt is trained exactly once, chunks that took new weights
mid-way are trained, and no token is older than algo.max_staleness allows."""

from __future__ import annotations

import json

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_nodes
from rlhf_async.metrics import read_metrics
from tests.faults import run_during, trained_counts

pytestmark = [pytest.mark.timeout(300)]

# long responses (min_new_tokens), few rows and a cheap train step (one minibatch, one
# epoch): the generator is the slow stage, so each publication lands while a chunk is
# decoding (about half-way through, on a loaded 2-core box)
PARTIAL = ["model.hidden=32", "model.layers=1", "model.heads=2", "model.max_positions=256",
           "sft.steps=30", "reward_model.steps=30", "reward_model.heldout_pairs=64",
           "run.eval_prompts=16", "train.prompts_per_step=4", "algo.group_size=2",
           "run.plot=false", "run.progress=false", "placement.strategy=separation",
           "placement.devices=2", "generation.partial_rollout=true", "algo.max_staleness=1",
           "generation.max_new_tokens=240", "generation.min_new_tokens=230", "train.epochs=1",
           "train.minibatches=1", "runtime.restart_limit=2", "runtime.time_to_dead=5",
           "weight_sync.timeout_s=10"]
SAMPLES = 4 * 2  # prompts_per_step x group_size


@pytest.mark.parametrize("continuous", [False, True], ids=["chunks", "continuous"])
def test_partial_rollouts_with_a_killed_generator_train_each_prompt_once(tmp_path, cache,
                                                                         continuous):
    steps = 6
    cfg = load_config(None, [*PARTIAL, f"run.cache_dir={json.dumps(str(cache))}",
                             f"generation.continuous_batching={str(continuous).lower()}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=partial",
                             f"train.steps={steps}"])
    victims: list = []
    # once 2 steps are trained: the generator is decoding a chunk of a later step then
    run_during(cfg, lambda stop: kill_nodes(tmp_path / "partial", ["gen0"], 1, stop, victims))
    assert [v for v, _ in victims] == ["gen0"], victims
    counts = trained_counts(tmp_path / "partial")
    assert set(counts) == set(range(steps * SAMPLES)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    records = read_metrics(tmp_path / "partial" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["faults/restarts"] >= 1
    # responses sampled by two versions were trained
    assert sum(r["partial/interrupted_rows"] for r in records) > 0, records
    for r in records:
        # the rollout's version is its oldest token's, within max_staleness of the sync one
        assert r["step"] - 1 <= r["rollout_version"] <= r["step"], r
        lags = {int(k.rsplit("/", 1)[1]) for k in r if k.startswith("partial/tokens_lag/")}
        assert lags and lags <= {0, 1}, r
