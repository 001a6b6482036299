"""The Python API: `rlhf_async.train`, called as a notebook calls it."""

from __future__ import annotations

import asyncio
import json

import pytest

import rlhf_async
from rlhf_async.config import ConfigError, load_config

pytestmark = [pytest.mark.timeout(300)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
        "reward_model.steps=20", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.steps=2", "train.prompts_per_step=4", "algo.group_size=2", "run.plot=false",
        "run.progress=false"]


def test_train_runs_separation_from_inside_a_running_event_loop(tmp_path, cache, one_thread):
    """A Jupyter cell runs inside the kernel's event loop; asyncio cannot nest loops, so
    the Separation pipeline's loop runs in a thread of its own while the cell waits."""
    over = [*TINY, "placement.strategy=separation", "placement.devices=2",
            f"run.cache_dir={json.dumps(str(cache))}",
            f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=nb"]

    async def cell() -> dict:
        return rlhf_async.train(None, over)

    summary = asyncio.run(cell())
    assert summary["run_dir"] == str(tmp_path / "nb")
    assert (tmp_path / "nb" / "policy" / "model.safetensors").exists()
    assert len((tmp_path / "nb" / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_takes_a_job_config_and_refuses_a_bad_one(tmp_path, cache):
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=cfg"])
    assert rlhf_async.train(cfg)["final_reward"] is not None
    cfg.train.steps = 0  # edited by hand: checked like a file
    with pytest.raises(ConfigError, match="train.steps"):
        rlhf_async.train(cfg)
    with pytest.raises(TypeError, match="give overrides with a TOML path"):
        rlhf_async.train(cfg, ["train.steps=1"])
