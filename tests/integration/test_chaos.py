"""Chaos: SIGKILL random non-coordinator nodes during one Separation run (a 2-rank trainer:
a killed rank takes its group down, the other rank restarts too). The run completes and
every prompt is trained on exactly once (counted from the trainer's log)."""

from __future__ import annotations

import json
import random

import pytest

from rlhf_async.config import load_config
from rlhf_async.control.chaos import freeze_nodes, kill_at_start, kill_nodes
from tests.faults import run_during, trained_counts

pytestmark = [pytest.mark.timeout(480)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false", "run.progress=false",
        "placement.strategy=separation", "placement.devices=4", "placement.actor=[0,1]",
        "placement.generators=2", "placement.scorers=1",
        "algo.max_staleness=1", "run.checkpoint_every=1", "runtime.restart_limit=8",
        "runtime.time_to_dead=5", "weight_sync.timeout_s=10"]


def test_run_survives_five_kills_and_trains_each_prompt_once(tmp_path, cache):
    steps, kills = 30, 5
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}", f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=chaos", f"train.steps={steps}"])
    victims: list = []
    # every role at least once, both trainer ranks, in a random order
    order = ["trainer", "gen0", "gen1", "scorer0", "trainer1"]
    random.Random(1).shuffle(order)
    summary = run_during(cfg, lambda stop: kill_nodes(tmp_path / "chaos", order, 5, stop,
                                                      victims))
    assert len(victims) == kills, f"only {victims} were killed before the run ended"
    counts = trained_counts(tmp_path / "chaos")
    n = 8 * 2
    assert set(counts) == set(range(steps * n)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    records = [json.loads(x) for x in (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["faults/restarts"] >= kills, victims
    assert summary["final_reward"] != summary["sft_reward"]  # the saved policy is the trained one


def test_kills_during_start_up_are_restarted_and_each_prompt_trained_once(tmp_path, cache):
    steps = 6
    cfg = load_config(None, [*TINY, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=boot",
                             f"train.steps={steps}", "runtime.restart_limit=3"])
    victims: list = []
    # one after another, each in its first seconds: while loading its models
    run_during(cfg, lambda stop: kill_at_start(
        tmp_path / "boot", ["scorer0", "gen0", "trainer1", "trainer"], stop, victims))
    assert [v for v, _ in victims] == ["scorer0", "gen0", "trainer1", "trainer"], victims
    counts = trained_counts(tmp_path / "boot")
    assert set(counts) == set(range(steps * 16)) and set(counts.values()) == {1}


SMALL = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
         "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
         "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false",
         "run.progress=false", "placement.strategy=separation", "placement.devices=3",
         "placement.generator=[1]", "placement.reward=[2]", "algo.max_staleness=1",
         "run.checkpoint_every=1", "runtime.restart_limit=2", "runtime.time_to_dead=3",
         "weight_sync.timeout_s=10"]


def test_frozen_nodes_are_dead_nodes_restarted_and_each_prompt_trained_once(tmp_path, cache):
    """SIGSTOP the generator (the trainer's next broadcast then waits on a frozen peer), the
    scorer and the trainer, one after another: each is declared dead after time_to_dead,
    killed while stopped and restarted; the run completes and trains every prompt once. A
    SIGCONT of each frozen process after its replacement is up finds it gone."""
    steps = 7
    cfg = load_config(None, [*SMALL, f"run.cache_dir={json.dumps(str(cache))}",
                             f"run.output_dir={json.dumps(str(tmp_path))}", "run.name=frozen",
                             f"train.steps={steps}"])
    victims: list[dict] = []
    order = ["gen0", "scorer0", "trainer"]
    run_during(cfg, lambda stop: freeze_nodes(tmp_path / "frozen", order, 2, stop, victims))
    assert [v["node"] for v in victims] == order, victims
    assert all("ready_s" in v and v["woke"] == "gone" for v in victims), victims
    counts = trained_counts(tmp_path / "frozen")
    assert set(counts) == set(range(steps * 16)) and set(counts.values()) == {1}
    records = [json.loads(x) for x in
               (tmp_path / "frozen" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["faults/restarts"] >= len(order), (records[-1], victims)
    # the trainer's next broadcast after the generator froze waited on it, and failed (not
    # hung) once the frozen peer was killed: re-sent to the new group
    trainer_log = (tmp_path / "frozen" / "logs" / "trainer.log").read_text()
    assert '"publish_failed"' in trainer_log or '"weight_sync_failed"' in trainer_log
    print("frozen:", json.dumps(victims))  # SIGSTOP -> restart per role: bench/README.md
