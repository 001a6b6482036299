"""bench.longtail's rows and idle share; bench.ttq's time-to-quality report."""

import pytest

from bench import longtail, ttq
from rlhf_async.config import load_config

pytestmark = pytest.mark.timeout(60)


def test_a_row_whose_key_is_not_in_the_schema_is_reported_missing():
    assert longtail.has_key("task", "long_fraction") and longtail.has_key("algo", "max_staleness")
    assert not longtail.has_key("generation", "no_such_key")
    assert longtail.missing_keys("flattening (sync)") == []
    assert longtail.missing_keys("separation k=1") == []
    want = [] if longtail.has_key("generation", "partial_rollout") \
        else ["generation.partial_rollout"]
    assert longtail.missing_keys("separation k=1 partial") == want


def test_every_row_this_tree_can_run_is_a_valid_config_of_the_long_tail_task():
    args = longtail.parse([])
    base = longtail.base_overrides(args, cores=2)
    runnable = [n for n in longtail.ROWS if not longtail.missing_keys(n)]
    assert {"flattening (sync)", "separation k=1"} <= set(runnable)
    for name in runnable:
        cfg = load_config(None, [*base, *longtail.row_overrides(name, 1024)])
        assert cfg.task.long_fraction == 0.1 and cfg.train.steps == 60
        assert cfg.placement.strategy == name.split()[0]
    assert longtail.parse(["--quick"]).rounds == 1


def test_interrupted_rows_are_counted_only_where_the_records_count_them():
    assert longtail.interrupted_rows([{"samples": 8}, {"samples": 8}]) is None
    recs = [{"partial/interrupted_rows": 3.0}, {"samples": 8}, {"partial/interrupted_rows": 0.0}]
    assert longtail.interrupted_rows(recs) == 3.0


def test_generator_idle_share_of_both_kinds_of_utilisation():
    assert longtail.generator_idle({"generate": 0.25, "score": 0.25, "train": 0.5}) == 0.75
    assert longtail.generator_idle({"gen": 0.4, "scorer": 0.3, "trainer": 0.9}) == \
        pytest.approx(0.6)
    with pytest.raises(KeyError, match="no generator"):
        longtail.generator_idle({"trainer": 0.9})


def _row(step_s, hidden, wall):
    s = ttq.summarise(step_s, [8] * len(step_s), [40] * len(step_s), hidden,
                              warmup=0, target=0.5)
    return {**s, "rl_wall_s": wall}


def test_time_to_quality_adds_the_time_outside_steps_and_compares_with_trls_soonest():
    rows = {"trl 1t": {**_row([1.0] * 4, [0.5] * 4, 4.5), "setup_s": 0.25},  # 3 s + 0.5 + 0.25 s
            "trl 2t": _row([2.0] * 4, [0.5] * 4, 8.0),  # at 6 s
            "flattening": _row([0.5] * 4, [0.4, 0.5, 0.6, 0.7], 3.75),  # at 1.5 s + 1.75 s
            "separation k=1": _row([0.5] * 4, [0.1] * 4, 3.0)}  # never
    q = ttq.time_to_quality(rows, 0.5)
    assert q["trl 1t"]["wall_s"] == pytest.approx(3.75) and q["trl 1t"]["vs_trl"] is None
    assert q["flattening"]["steps_s"] == 1.5 and q["flattening"]["overhead_s"] == 1.75
    assert q["flattening"]["vs_trl"] == pytest.approx(3.25 / 3.75)
    assert q["flattening"]["vs_trl_steps"] == pytest.approx(1.5 / 3.0)
    # a wider window waits for more batches: (0.5, 0.6, 0.7) first reaches 0.6 at 2 s
    assert ttq.time_to_quality(rows, 0.6, window=3)["flattening"]["steps_s"] == 2.0
    assert ttq.time_to_quality(rows, 0.5, window=4)["flattening"]["steps_s"] == 2.0
    assert q["separation k=1"]["wall_s"] is None and q["separation k=1"]["vs_trl"] is None
    rows.pop("trl 1t"), rows.pop("trl 2t")
    assert ttq.time_to_quality(rows, 0.5)["flattening"]["vs_trl"] is None


def test_longtail_writes_each_rows_series_apart_from_its_numbers(tmp_path):
    import json

    results = {"separation k=1": {"samples_per_s": 633.0, "series": {"t": [0.5, 1.0]}}}
    out, series = tmp_path / "results" / "longtail.json", tmp_path / "runs" / "s.json"
    longtail.write_results(out, series, results, {"cores": 2})
    written = json.loads(out.read_text())
    assert written.pop("meta")["bench"]  # the suite's shared header (bench/output.py)
    assert written == {"cores": 2, "results": {"separation k=1": {"samples_per_s": 633.0}}}
    assert json.loads(series.read_text())["series"] == {"separation k=1": {"t": [0.5, 1.0]}}
    assert results["separation k=1"]["series"] == {"t": [0.5, 1.0]}  # the caller's left whole

