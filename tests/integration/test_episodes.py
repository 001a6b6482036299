"""Multi-turn episodes (the calculator task) under every strategy: Separation's generators
run the same episodes as Flattening at max_staleness = 0, and a generator SIGKILLed with
episodes in flight loses none and trains none twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.control.chaos import kill_nodes
from rlhf_async.metrics import read_metrics
from tests.faults import run_during, trained_counts

pytestmark = [pytest.mark.timeout(300)]

TINY = ["task.name=calculator", "model.hidden=32", "model.layers=1", "model.heads=2",
        "sft.steps=30", "run.eval_prompts=16", "train.prompts_per_step=8",
        "algo.group_size=2", "run.plot=false", "run.progress=false"]


def _cfg(tmp_path, cache, name, *overrides):
    return load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                              f"run.output_dir={json.dumps(str(tmp_path))}", f"run.name={name}",
                              *overrides])


def test_separation_matches_flattening_with_an_environment(tmp_path, cache, one_thread):
    job.run(_cfg(tmp_path, cache, "flat", "train.steps=2"))
    job.run(_cfg(tmp_path, cache, "sep", "train.steps=2", "placement.strategy=separation",
                 "placement.devices=2", "algo.max_staleness=0"))
    flat = read_metrics(tmp_path / "flat" / "metrics.jsonl")
    sep = read_metrics(tmp_path / "sep" / "metrics.jsonl")
    assert len(flat) == len(sep) == 2
    for a, b in zip(flat, sep, strict=True):
        for k in ("policy_loss", "reward", "kl", "entropy", "response_length", "value_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    # the generators' engine kept each episode's KV across its turns, counted per step
    # (Flattening generates with the rank's own model: no engine, no counts)
    assert any(r["kv/hits"] > 0 and r["kv/reused_tokens"] > 0 for r in sep)  # a 2nd turn
    assert all(r["kv/hits"] + r["kv/misses"] >= r["samples"] for r in sep)  # a turn each
    assert not any(k.startswith("kv/") for k in flat[0])


def test_the_calculator_agent_trains_as_the_built_in_episodes(tmp_path, cache, one_thread):
    """examples/calculator_agent/builtin.py through the endpoint, two steps: the run the
    built-in episode loop makes (same tokens, so the same losses and rewards)."""
    agent = Path(__file__).parents[2] / "examples/calculator_agent/builtin.py"
    job.run(_cfg(tmp_path, cache, "flat", "train.steps=2"))
    job.run(_cfg(tmp_path, cache, "agent", "train.steps=2",
                 f"task.agent={json.dumps(str(agent) + ':run')}"))
    flat = read_metrics(tmp_path / "flat" / "metrics.jsonl")
    agent_run = read_metrics(tmp_path / "agent" / "metrics.jsonl")
    assert len(flat) == len(agent_run) == 2
    for a, b in zip(flat, agent_run, strict=True):
        for k in ("policy_loss", "reward", "kl", "response_length", "episodes/done",
                  "episodes/truncated"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)


def test_a_killed_generator_with_episodes_in_flight_trains_every_prompt_once(tmp_path, cache):
    steps = 8
    cfg = _cfg(tmp_path, cache, "kill", f"train.steps={steps}", "placement.strategy=separation",
               "placement.devices=3", "algo.max_staleness=1", "run.checkpoint_every=1",
               "runtime.restart_limit=4", "runtime.time_to_dead=5", "weight_sync.timeout_s=10")
    victims: list = []
    run_during(cfg, lambda stop: kill_nodes(tmp_path / "kill", ["gen0"], 2, stop, victims))
    assert [v for v, _ in victims] == ["gen0"], victims
    counts = trained_counts(tmp_path / "kill")
    assert set(counts) == set(range(steps * 16)) and set(counts.values()) == {1}
