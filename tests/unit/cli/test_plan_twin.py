"""`plan --twin`'s reading of a twin run's step records, and its refusal of a real job."""

from __future__ import annotations

import pytest

from rlhf_async.cli.plan_twin import format_twin, measure, run_twin
from rlhf_async.config import ConfigError, load_config


def _record(step: int, t: float) -> dict:
    return {"step": step, "time_step": t, "samples_per_s": 32 / t, "util/gen0": 0.2,
            "util/gen1": 0.4, "util/scorer0": 0.1, "util/trainer": 0.9, "queue/dispatched": 1,
            "queue/trainer": 0, "staleness/mean": 1.0, "staleness/dropped_total": 2,
            "control/real_s": 0.05, "control/share": 0.005, "real/time_step": t / 10}


def test_measure_takes_medians_after_the_warm_up_and_averages_each_role():
    records = [_record(0, 100.0), _record(1, 50.0)] + [_record(s, 10.0) for s in range(2, 7)]
    m = measure(records)
    assert m["steps"] == 7 and m["step_s"] == 10.0 and m["samples_per_s"] == 3.2
    assert m["utilisation"] == pytest.approx({"generator": 0.3, "scorer": 0.1, "trainer": 0.9})
    assert m["queues"] == {"dispatched": 1, "trainer": 0} and m["dropped_stale"] == 2
    cfg = load_config(None, ["placement.strategy=separation", "placement.device=sim",
                             "train.backend=sim", "placement.devices=8"])
    text = format_twin(cfg, m, {"step_s": 8.0, "samples_per_s": 4.0,
                                "phases_s": {"generate": 3.0, "train": 7.5}}, "runs/x")
    assert "| step time (simulated s) | 10.00 | 8.00 |" in text
    assert "| utilisation: generator | 0.30 | |" in text and "| train (s) | | 7.50 |" in text


def test_a_real_job_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="placement.device = 'sim'"):
        run_twin(load_config(None, []), 3, False)
