"""Following metrics.jsonl into TensorBoard / W&B sinks (a fake sink here; the TensorBoard
event files are read back in tests/integration/test_reporting.py)."""

from __future__ import annotations

import json

import pytest

from rlhf_async.config import ConfigError, load_config
from rlhf_async.metrics import MetricsWriter, truncate_metrics
from rlhf_async.ops.reporting import Reporter, numbers


class Sink:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.samples: list[tuple[int, list]] = []
        self.closed = False

    def log_samples(self, step: int, rows: list) -> None:
        self.samples.append((step, rows))

    def log(self, step: int, values: dict) -> None:
        self.logged.append((step, values))

    def close(self) -> None:
        self.closed = True


def test_new_steps_are_reported_once_across_a_resume_rewrite(tmp_path):
    sink = Sink()
    rep = Reporter(tmp_path, [sink])
    rep.drain()  # no file yet
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    for s in range(3):
        w.write({"step": s, "loss": 0.5 - s / 10, "faults": {"restarts": 0}, "ok": True,
                 "hist": "x", "nan": float("nan")})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # being written
    rep.drain()
    assert [s for s, _ in sink.logged] == [0, 1, 2]
    assert sink.logged[0][1] == {"loss": 0.5, "faults/restarts": 0.0}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('ss": 0.2}\n')  # finished
    rep.drain()
    assert [s for s, _ in sink.logged] == [0, 1, 2, 3]
    w.close()
    truncate_metrics(tmp_path, 2)  # a resume from the checkpoint of step 2: a new file
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    for s in (2, 3, 4):
        w.write({"step": s, "loss": 0.1})
    w.close()
    rep.close()
    assert [s for s, _ in sink.logged] == [0, 1, 2, 3, 4] and sink.closed


def test_samples_are_reported_once_per_step(tmp_path):
    sink = Sink()
    rep = Reporter(tmp_path, [sink])
    w = MetricsWriter(tmp_path / "samples.jsonl")
    rows = [{"prompt": "a", "response": "b", "reward": 1.0}]
    w.write({"step": 0, "samples": rows})
    w.write({"step": 1, "samples": []})  # nothing logged this step: nothing reported
    rep.drain()
    w.write({"step": 0, "samples": rows})  # a step seen already
    w.write({"step": 2, "samples": rows})
    w.close()
    rep.close()
    assert sink.samples == [(0, rows), (2, rows)] and sink.logged == []


def test_numbers_flatten_and_skip_what_is_not_a_finite_number():
    assert numbers({"step": 4, "a": 1, "b": {"c": 2.5, "d": [1]}, "e": float("inf")}) == \
        {"a": 1.0, "b/c": 2.5}


def test_unknown_or_missing_sinks_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="run.report_to: unknown 'mlflow'; accepted: "
                                          "tensorboard, wandb"):
        load_config(None, [f"run.report_to={json.dumps(['mlflow'])}"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb is not installed \(pip install "
                                          r"'rlhf-async\[wandb\]'\)"):
        load_config(None, ['run.report_to=["wandb"]'])
