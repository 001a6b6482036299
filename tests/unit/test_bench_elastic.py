"""bench/elastic.py without running a job: rates, the splits it places, the exactly-once
check it reports, its arguments (the command itself: `python -m bench.elastic --quick`)."""

from __future__ import annotations

import json

from bench.elastic import exactly_once, parse, rate, split
from rlhf_async.config import load_config
from rlhf_async.strategies.registry import runnable_placement


def test_rates_are_samples_over_step_time():
    assert rate([{"samples": 32, "time_step": 2.0}, {"samples": 32, "time_step": 6.0}]) == 8.0


def test_each_split_places_the_trainer_alone_and_shares_the_rest():
    cfg = load_config(None, ["placement.strategy=separation", "placement.devices=5",
                             *split(3, 4)])
    p = runnable_placement(cfg)
    assert [(q.role, q.devices) for q in p.processes] == [
        ("trainer", (0,)), ("generator", (1,)), ("generator", (2,)), ("generator", (3,)),
        ("scorer", (4,))]


def test_exactly_once_reports_a_repeated_or_missing_sample(tmp_path):
    recs = [{"step": 0, "samples": 2}, {"step": 1, "samples": 2}]
    lines = [{"step": 0, "sample_ids": [0, 1]}, {"step": 1, "sample_ids": [2, 3]}]
    (tmp_path / "trained_samples.jsonl").write_text("\n".join(map(json.dumps, lines)))
    assert exactly_once(tmp_path, recs) == {"steps_in_order": True,
                                            "samples_trained_once": True, "restarts": 0}
    lines[1]["sample_ids"] = [1, 3]  # sample 1 twice, sample 2 never
    (tmp_path / "trained_samples.jsonl").write_text("\n".join(map(json.dumps, lines)))
    assert not exactly_once(tmp_path, recs)["samples_trained_once"]
    assert not exactly_once(tmp_path, recs[::-1])["steps_in_order"]


def test_quick_is_small():
    args = parse(["--quick"])
    assert (args.inference, args.static_steps, args.rebalance_steps) == (3, 4, 12)
    assert parse([]).sections == ["scale", "generation-bound", "training-bound"]
