"""summary.json of the built-in run: the reward model it trained and used, what it
trained on, and no collapse warning for a healthy run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from rlhf_async import job
from rlhf_async.config import load_config

pytestmark = [pytest.mark.timeout(300)]


def test_the_built_in_run_names_the_reward_model_it_trained(tmp_path, cache):
    # the SFT and reward-model settings of tests/integration/test_flattening.py: cached once
    cfg = load_config(None, [f"run.cache_dir={cache}", "sft.steps=40", "reward_model.steps=40",
                             "train.steps=2", "train.prompts_per_step=6", "algo.group_size=2",
                             "run.eval_prompts=8", "run.plot=false", "run.progress=false",
                             f"run.output_dir={tmp_path}", "run.name=builtin"])
    out = io.StringIO()
    with structlog.testing.capture_logs() as logs:
        summary = job.run(cfg, out)
    rm = Path(summary["reward_model"])
    assert rm.parent == cache and (rm / "stats.json").exists()  # trained here, into the cache
    assert json.loads((tmp_path / "builtin" / "summary.json").read_text())["reward_model"] \
        == str(rm)
    # single-turn: no episodes to fail; every sample trained
    assert summary["episodes"] == summary["episodes_failed"] == summary["failed_steps"] == 0
    assert summary["trained_samples"] == 2 * 6 * 2
    assert "trained on 24 samples; episodes failed 0, truncated 0, timed out 0\n" in \
        out.getvalue()
    assert not [e for e in logs if e["event"] == "the policy may have collapsed"]
