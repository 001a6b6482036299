"""The rules every strategy applies to its step records (`strategies/step_health.py`), on
hand-made records: steps that trained on nothing, counted and, after
run.max_failed_steps in a row, the error that stops the run; one collapse warning."""

from __future__ import annotations

import pytest
import structlog

from rlhf_async.config import load_config
from rlhf_async.strategies.base import UserCodeFailed
from rlhf_async.strategies.step_health import StepHealth, trained_nothing


def _health(tmp_path, *overrides):
    cfg = load_config(None, ["run.max_failed_steps=3", "algo.kl_target=2.0", "train.lr=5e-4",
                             "generation.max_new_tokens=8", *overrides])
    return StepHealth(cfg, tmp_path / "run")


def _step(done=0, failed=0, timeout=0, truncated=0, kl=0.5, length=3.0):
    return {"episodes/done": done, "episodes/max_turns": 0, "episodes/failed": failed,
            "episodes/timeout": timeout, "episodes/truncated": truncated, "kl": kl,
            "response_length": length}


def test_a_step_trained_nothing_only_when_every_episode_failed_or_timed_out():
    assert trained_nothing(_step(failed=3, timeout=1))
    assert not trained_nothing(_step(done=1, failed=3))
    assert not trained_nothing(_step(failed=3, truncated=1))  # a truncated one trains
    assert not trained_nothing({"kl": 0.1, "response_length": 2.0})  # single-turn: none


def test_max_failed_steps_in_a_row_stop_the_run_naming_the_first_error(tmp_path):
    h = _health(tmp_path)
    assert h.observe(0, _step(failed=4), "task.agent a.py:run: run() raised KeyError "
                                         "(at a.py:3)") == {"failed_steps": 1}
    assert h.observe(1, _step(done=1, failed=3)) == {"failed_steps": 0}  # trained: reset
    seen = [h.observe(s, _step(failed=3, timeout=1), f"error of step {s}")["failed_steps"]
            for s in (2, 3)]
    assert seen == [1, 2] and h.failure is None
    assert h.observe(4, _step(timeout=4), "")["failed_steps"] == 3
    assert isinstance(h.failure, UserCodeFailed)  # the CLI's one-line error
    assert str(h.failure) == (
        "nothing trained in 3 steps in a row (steps 3-5; run.max_failed_steps = 3): every "
        "episode failed (6 failed, 6 timed out, 0 truncated, of 12); the first error: error "
        "of step 2")
    stop = str(h.stop())
    assert stop.startswith(str(h.failure)) and "before its first checkpoint" in stop
    assert f"`rlhf-async resume {tmp_path / 'run'}`" in stop
    first = h.failure
    h.observe(5, _step(failed=4))  # a step reported after the verdict: decided once
    assert h.failure is first


def test_a_failure_without_a_reported_error_says_where_to_look(tmp_path):
    h = _health(tmp_path, "run.max_failed_steps=1")
    h.observe(7, _step(failed=2))
    assert "nothing trained in 1 step in a row (step 8;" in str(h.failure)
    assert "the first error: not reported (see the warnings in the run's log)" in \
        str(h.failure)


def _warnings(h, steps):
    with structlog.testing.capture_logs() as logs:
        for i, s in enumerate(steps):
            h.observe(i, s)
    return [e for e in logs if e["event"] == "the policy may have collapsed"]


@pytest.mark.parametrize(("steps", "seen"), [
    ([_step(done=4, kl=0.0), _step(done=4, kl=37.0)],
     "the KL to the reference is 37 nats a sample, over 5x algo.kl_target = 2"),
    ([_step(done=4), _step(truncated=4, length=8.0)],
     "every episode (4) ran out of tokens (truncated)"),
    ([{"kl": 0.1, "response_length": 3.0}, {"kl": 0.2, "response_length": 8.0}],
     "every response is at the length limit (generation.max_new_tokens = 8)"),
])
def test_a_collapse_warns_once_naming_the_learning_rate(tmp_path, steps, seen):
    warned = _warnings(_health(tmp_path), [*steps, *steps[1:] * 3])
    assert len(warned) == 1 and warned[0]["step"] == 1 and warned[0]["seen"] == seen
    assert "train.lr = 0.0005" in warned[0]["hint"] and "train.lr=5e-05" in warned[0]["hint"]


def test_a_healthy_run_does_not_warn(tmp_path):
    steps = [_step(done=3, truncated=1, kl=9.9, length=7.5),  # KL under 5x the target
             {"kl": 0.1, "response_length": 7.9}]  # some responses end before the limit
    assert _warnings(_health(tmp_path), steps) == []
    # at the limit from the first step on: the model's way, not a collapse
    assert _warnings(_health(tmp_path), [{"kl": 0.0, "response_length": 8.0}] * 3) == []
    assert _warnings(_health(tmp_path), [_step(truncated=4)] * 3) == []
    # algo.kl_target = 0 (a fixed KL weight): no target to be far above
    assert _warnings(_health(tmp_path, "algo.kl_target=0"), [_step(done=4, kl=90.0)]) == []
