"""Flattening over 2 worker processes (gloo) == 1 process on the same global batch."""

import pytest
from safetensors.torch import load_file

from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics
from rlhf_async.strategies import flattening
from rlhf_async.strategies.registry import plan_placement
from rlhf_async.task import SortDigitsTask
from rlhf_async.task.artefacts import prepare_artefacts


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_two_processes_match_one(tmp_path, cache, algo):
    base = [f"run.cache_dir={cache}", "sft.steps=40", "reward_model.steps=40",
            "train.steps=3", "train.prompts_per_step=6", "algo.group_size=2",
            "train.minibatches=3", "run.progress=false", f"algo.name={algo}", "algo.is_cap=2.0"]
    results = {}
    for devices in (1, 2):
        cfg = load_config(None, [*base, f"placement.devices={devices}"])
        art = prepare_artefacts(cfg, SortDigitsTask(cfg.task))
        res = flattening.run(cfg, plan_placement(cfg.placement, cfg.algo.name), art,
                             tmp_path / f"d{devices}")
        results[devices] = (read_metrics(res.metrics_path),
                            load_file(str(res.policy_dir / "model.safetensors")))
    sft = load_file(str(art.sft_dir / "model.safetensors"))
    (m1, w1), (m2, w2) = results[1], results[2]
    assert len(m1) == len(m2) == 3
    keys = ["policy_loss", "reward", "kl", "entropy", "response_length", "samples"]
    keys += ["value_loss"] if algo == "ppo" else []
    for a, b in zip(m1, m2, strict=False):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (k, a[k], b[k])
    moved = max((w1[k] - sft[k]).abs().max().item() for k in w1)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert diff < 2e-3 and moved > 10 * diff, (moved, diff)
