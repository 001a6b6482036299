"""Chaos: SIGKILL random non-coordinator nodes during one Separation run. The run completes
and every prompt is trained on exactly once (counted from the trainer's log)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections import Counter

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.coordinator import call_coordinator, read_coordinator_file

pytestmark = [pytest.mark.timeout(480)]

TINY = ["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=30",
        "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
        "train.prompts_per_step=8", "algo.group_size=2", "run.plot=false", "run.progress=false",
        "placement.strategy=separation", "placement.devices=3", "placement.generators=2",
        "algo.max_staleness=1", "run.checkpoint_every=1", "runtime.restart_limit=8",
        "runtime.time_to_dead=5", "weight_sync.timeout_s=10"]


def _status(run_dir):
    info = read_coordinator_file(run_dir)
    return asyncio.run(call_coordinator(info["control"], "status", timeout=2.0))


def _killer(run_dir, kills: int, victims: list, stop: threading.Event) -> None:
    """Kill a node every few trained steps, whatever the others are doing: every role at
    least once (the trainer twice), in a random order."""
    order = ["trainer", "gen0", "gen1", "scorer0", "trainer"][:kills]
    random.Random(1).shuffle(order)
    metrics = run_dir / "metrics.jsonl"
    while len(victims) < kills and not stop.is_set():
        time.sleep(0.1)
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps < 2 + 5 * len(victims):
            continue
        try:
            nodes = _status(run_dir)["nodes"]
        except Exception:  # not up yet, or shutting down
            continue
        victim = order[len(victims)]
        if nodes[victim]["state"] != "ready" or not nodes[victim]["pid"]:
            continue  # still restarting from an earlier kill
        os.kill(nodes[victim]["pid"], signal.SIGKILL)
        victims.append((victim, steps))


def test_run_survives_five_kills_and_trains_each_prompt_once(tmp_path):
    steps, kills = 40, 5
    cfg = load_config(None, TINY + [f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
                                    f"run.output_dir={json.dumps(str(tmp_path))}",
                                    "run.name=chaos", f"train.steps={steps}"])
    victims: list = []
    stop = threading.Event()
    thread = threading.Thread(target=_killer, args=(tmp_path / "chaos", kills, victims, stop))
    thread.start()
    try:
        summary = job.run(cfg)
    finally:
        stop.set()
        thread.join()
    assert len(victims) == kills, f"only {victims} were killed before the run ended"
    lines = (tmp_path / "chaos" / "trained_samples.jsonl").read_text().splitlines()
    counts = Counter(s for line in lines for s in json.loads(line)["sample_ids"])
    n = 8 * 2
    assert set(counts) == set(range(steps * n)), "some prompts were never trained"
    assert set(counts.values()) == {1}, "some prompts were trained more than once"
    records = [json.loads(x) for x in (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert records[-1]["faults/restarts"] >= kills, victims
    assert summary["final_hidden_score"] >= 0
