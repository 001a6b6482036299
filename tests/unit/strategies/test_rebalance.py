"""Online rebalancing's decisions from step records, hand-computed: the stage work each
window measures, the cost model's step for the shape and its neighbours, the threshold,
and the window that waits while a move is under way."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from rlhf_async.config import load_config
from rlhf_async.control.reshape import Scale
from rlhf_async.log import configure_logging, log_to_file
from rlhf_async.strategies.registry import runnable_placement
from rlhf_async.strategies.separation.rebalance import (
    Rebalancer,
    Work,
    neighbours,
    predicted_step,
)

# trainer on 0, one generator on 1, three scorers on 2, 3, 4
P = runnable_placement(load_config(None, [
    "placement.strategy=separation", "placement.devices=5", "placement.generator=[1]",
    "placement.reward=[2,3,4]", "algo.max_staleness=1"]))
ROLES = {q.node_id: q.role for q in P.processes}
DRIVER = SimpleNamespace(joining=set())


def _record(gen: float, scorer: float, trainer: float = 0.5, dt: float = 1.0) -> dict:
    return {"step": 0, "time_step": dt, "util/gen0": gen, "util/scorer0": scorer,
            "util/scorer1": scorer, "util/scorer2": scorer, "util/trainer": trainer}


def test_work_is_busy_seconds_per_step_summed_over_a_stages_processes():
    work = Work.of([_record(1.0, 0.2), _record(0.5, 0.1, dt=2.0)], ROLES)
    # generate (1.0*1 + 0.5*2)/2 = 1.0; score 3*(0.2*1 + 0.1*2)/2 = 0.6; train (0.5+1.0)/2
    assert work == Work(pytest.approx(1.0), pytest.approx(0.6), pytest.approx(0.75))


def test_a_generation_bound_job_moves_a_scorer_device_to_the_generators():
    work = Work(generate=1.0, score=0.6, train=0.5)
    # generators and scorers apart, staleness 1: step = max(max(gen, score), train) and the
    # staleness gate's cycle (gen + score + train) / 2 = (1.0 + 0.2 + 0.5) / 2 = 0.85
    assert predicted_step(P, work, 1) == pytest.approx(1.0)
    (scale, shape), = neighbours(P)  # one generator: only scorer -> generator
    assert scale == Scale(generators=2, scorers=2)
    assert [q.node_id for q in shape.by_role("generator")] == ["gen0", "gen1"]
    # max(0.5, 0.3, 0.5) = 0.5, but the gate's cycle (0.5 + 0.3 + 0.5) / 2 = 0.65 binds
    assert predicted_step(shape, work, 1) == pytest.approx(0.65)
    rb = Rebalancer(SimpleNamespace(placement=P), 2, 0.1, 1, lambda t: None)  # type: ignore[arg-type]
    d = rb.decide([_record(1.0, 0.2)])
    assert d["scale"] == Scale(generators=2, scorers=2)
    assert (d["predicted_step_s"], d["best_step_s"], d["gain"]) == pytest.approx((1.0, 0.65, 0.35))


def test_no_move_below_the_threshold():
    rb = Rebalancer(SimpleNamespace(placement=P), 2, 0.1, 1, lambda t: None)  # type: ignore[arg-type]
    # generate 0.3, score 0.6, train 0.5: now max(0.3, 0.2, 0.5) = 0.5; two generators
    # max(0.15, 0.3, 0.5) = 0.5: the trainer bounds both, no gain
    d = rb.decide([_record(0.3, 0.2)])
    assert d["scale"] is None and d["moved"] == 0 and d["gain"] == pytest.approx(0.0)
    # a gain of 0.2 against a threshold of 0.25: kept
    rb.gain = 0.25
    assert rb.decide([_record(1.0, 0.2, trainer=0.8)])["scale"] is None  # 1.0 -> 0.8


def test_a_window_decides_once_and_waits_while_the_move_is_under_way():
    async def main() -> None:
        moves: list[Scale] = []
        gate = asyncio.Event()

        async def scale(s: Scale) -> Any:
            moves.append(s)
            await gate.wait()
            return SimpleNamespace(added=["gen1"], removed=["scorer2"], counts={})

        rb = Rebalancer(SimpleNamespace(placement=P, scale=scale, driver=DRIVER), 2, 0.1, 1,  # type: ignore[arg-type]
                        lambda t: None)
        first, second = _record(1.0, 0.2), _record(1.0, 0.2)
        rb.observe(first)
        assert "rebalance/gain" not in first  # half a window
        rb.observe(second)
        assert second["rebalance/moved"] == 1 and second["rebalance/gain"] == pytest.approx(0.35)
        await asyncio.sleep(0)
        assert moves == [Scale(generators=2, scorers=2)]
        for _ in range(4):  # steps during the move measure neither shape: not counted
            rb.observe(_record(1.0, 0.2))
        assert rb.window == [] and len(moves) == 1
        gate.set()
        await asyncio.sleep(0)
        DRIVER.joining.add("gen1")  # started, still loading its models: not counted
        rb.observe(_record(1.0, 0.2))
        assert rb.window == []
        DRIVER.joining.clear()
        rb.observe(_record(1.0, 0.2))
        assert len(rb.window) == 1
    asyncio.run(main())


def test_every_decision_is_a_line_on_the_console_and_a_record_in_the_log(capsys, tmp_path):
    """The README promised a `rebalance_decision` log line that showed nowhere a user
    looks: each decision, moved or kept, is a sentence on the console (shape, predicted
    step, gain against the threshold) and its record in the run's log file."""
    configure_logging("warning", json=False)
    rb = Rebalancer(SimpleNamespace(placement=P), 2, 0.1, 1, lambda t: None)  # type: ignore[arg-type]
    with log_to_file(tmp_path / "job.log"):
        rb.decide([_record(1.0, 0.2) | {"step": 7}])  # gain 0.35: moves
        rb.decide([_record(0.3, 0.2) | {"step": 9}])  # gain 0: kept
    moved, kept = capsys.readouterr().err.splitlines()
    assert moved == ("[rebalance] after 8 steps: moving a device from the scorers to the "
                     "generators (1 generator + 3 scorers -> 2 generators + 2 scorers): "
                     "predicted step 1 s -> 0.65 s, gain 35% > placement.rebalance_gain 10%")
    assert kept == ("[rebalance] after 10 steps: keeping 1 generator + 3 scorers: the best "
                    "shape one device away predicts 0.5 s against 0.5 s now, gain 0% <= "
                    "placement.rebalance_gain 10%")
    records = [json.loads(x) for x in (tmp_path / "job.log").read_text().splitlines()]
    assert [(r["event"], r["gain"]) for r in records] == [("rebalance_decision", 0.35),
                                                          ("rebalance_decision", 0.0)]
    assert records[0]["shape"] == {"generator": 1, "scorer": 3}


def test_a_shape_with_no_neighbour_says_so():
    one = runnable_placement(load_config(None, [
        "placement.strategy=separation", "placement.devices=3", "placement.generator=[1]",
        "placement.reward=[2]"]))
    rb = Rebalancer(SimpleNamespace(placement=one), 2, 0.1, 1, lambda t: None)  # type: ignore[arg-type]
    with capture_logs() as logs:
        rb.decide([{"step": 3, "time_step": 1.0, "util/gen0": 1.0, "util/scorer0": 0.1,
                    "util/trainer": 0.2}])
    (decision,) = logs
    assert decision["console"] == ("after 4 steps: keeping 1 generator + 1 scorer: no shape "
                                   "is one device away (a role gives a device only from a "
                                   "second process on a device of its own)")
