"""Interleaving over real processes: the same trajectory as Flattening at max_staleness = 0
(2 and 3 devices, reference and reward on exclusive groups), and `auto` through the same
CLI path picks a strategy and keeps the trajectory."""

from __future__ import annotations

import json

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
        "train.steps=3", "train.prompts_per_step=6", "algo.group_size=2", "run.plot=false",
        "run.progress=false"]


@pytest.fixture(scope="module")
def flat(tmp_path_factory, cache):
    """Flattening in this process with one torch thread, like the worker processes: a
    different thread count changes float reduction order (and Adam magnifies it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _run(tmp_path_factory.mktemp("flat"), cache, "flat")
    torch.set_num_threads(before)


def _run(tmp_path, cache, name, *overrides):
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}", f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}", *overrides])
    summary = job.run(cfg)
    weights = load_file(str(tmp_path / name / "policy" / "model.safetensors"))
    return summary, read_metrics(tmp_path / name / "metrics.jsonl"), weights


def _same_trajectory(a, b):
    (_, ma, wa), (_, mb, wb) = a, b
    keys = ["policy_loss", "value_loss", "reward", "kl", "entropy", "response_length",
            "samples"]
    assert len(ma) == len(mb) == 3
    for ra, rb in zip(ma, mb, strict=False):
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-5), (ra["step"], k)
    # ranks sum gradients in another order than one process: Adam turns that into a fraction
    # of one step (lr 5e-4) on near-zero gradients
    assert_same_policy(wa, wb, atol=2e-4)


@pytest.mark.parametrize("devices", [2, 3])
def test_interleaving_matches_flattening(tmp_path, cache, flat, devices):
    """PPO (the Learner is shared by every algorithm; scoring is what interleaving changes).
    3 devices: uneven shards, reference on 0-1 and reward on 2."""
    inter = _run(tmp_path, cache, "inter", "placement.strategy=interleaving",
                 f"placement.devices={devices}")
    _same_trajectory(flat, inter)
    table = (tmp_path / "inter" / "placement.txt").read_text()
    ref, rw = ("0", "1") if devices == 2 else ("0-1", "2")
    assert f"reference  infer    {ref}" in table and f"reward     infer    {rw}" in table


def test_auto_picks_a_strategy_and_keeps_the_trajectory(tmp_path, cache, flat):
    auto = _run(tmp_path, cache, "auto", "placement.strategy=auto", "placement.devices=2")
    assert auto[0]["strategy"] in ("flattening", "interleaving", "separation")
    _same_trajectory(flat, auto)
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert saved["placement"]["strategy"] == auto[0]["strategy"]
