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
    assert (args.inference, args.static_steps, args.rebalance_steps) == (3, 4, 80)
    assert parse([]).sections == ["scale", "generation-bound", "training-bound"]


def test_every_job_of_the_full_bench_is_a_valid_separation_job():
    """The jobs `python -m bench.elastic` runs on 16 cores, placed without running them."""
    from bench.elastic import CONFIGS, LONG, config

    args = parse(["--cores", "16"])
    scale = runnable_placement(config(args, 4, "scale", *LONG, *split(1, 2)))
    assert [q.node_id for q in scale.processes] == ["trainer", "gen0", "scorer0"]
    jobs = [config(args, 5, "x", *over, *split(g, 4)) for over in CONFIGS.values()
            for g in range(1, 4)]
    for cfg in jobs:
        assert cfg.placement.cpu_threads == 3 and cfg.train.prompts_per_step == 32
        assert len(runnable_placement(cfg).processes) == 5


def test_a_rebalanced_job_is_measured_from_two_steps_after_its_last_change_of_shape():
    from bench.elastic import converged, settled_from

    one = {"util/gen0": 1.0, "util/scorer0": 0.1, "util/scorer1": 0.1}
    two = {"util/gen0": 1.0, "util/gen1": 0.9, "util/scorer0": 0.2}
    recs = [{"step": i, **one} for i in range(4)]
    recs[2]["rebalance/moved"] = 1  # decided at step 2; gen1 works from step 5
    recs.append({"step": 4, **one, "util/gen1": 0.0, "util/scorer1": 0.0})
    recs += [{"step": i, **two} for i in range(5, 12)]
    assert settled_from(recs) == 5 + 2  # scorer1 gone and gen1 in from step 5
    assert not converged(recs, 3)  # no decision since
    recs[8]["rebalance/moved"] = 0
    assert converged(recs, 3) and converged(recs, 5) and not converged(recs, 6)
    recs[6]["rebalance/moved"] = 0  # before the shape settled: does not count
    recs[8].pop("rebalance/moved")
    assert not converged(recs, 3)
