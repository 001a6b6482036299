"""Separation's step from its phases, by hand: the busiest side when generation overlaps
training, the sides added when it may not, and the staleness gate's cycle where it binds."""

import pytest

from rlhf_async.config import PlacementConfig
from rlhf_async.strategies.pricing import StepCosts
from rlhf_async.strategies.registry import plan_placement
from rlhf_async.strategies.separation.pricing import gate_cycle, price

# one trainer rank, six generators, one scorer: each stage on devices of its own
PLACEMENT = plan_placement(PlacementConfig(strategy="separation", devices=8, actor=[0],
                                           generator=[1, 2, 3, 4, 5, 6], reward=[7]), "ppo")


def _costs(k: int, generate: float = 8.0, score: float = 4.0, train: float = 6.0,
           sync: float = 2.0) -> StepCosts:
    return StepCosts(generate=generate, score=score, train=train, sync=sync, exchange=0.0,
                     slowdown=1.0, pipeline_s=0.5, max_staleness=k)


def test_with_one_step_of_staleness_the_gate_cycle_binds_a_balanced_pipeline():
    # sides: inference max(8, 4) = 8, trainer 6 + 2 = 8; the cycle (8 + 4 + 6 + 2) / 2 = 10
    assert gate_cycle(_costs(1)) == 10.0
    assert price(PLACEMENT, _costs(1))[0] == pytest.approx(0.5 + 10.0)


def test_more_staleness_lets_the_busiest_side_bind_again():
    # k = 3: the cycle 20 / 4 = 5 is below either side's 8
    assert gate_cycle(_costs(3)) == 5.0
    assert price(PLACEMENT, _costs(3))[0] == pytest.approx(0.5 + 8.0)


def test_an_unbalanced_pipeline_is_its_busiest_side():
    # generation 30: the cycle (30 + 4 + 6 + 2) / 2 = 21 is below the inference side's 30
    assert price(PLACEMENT, _costs(1, generate=30.0))[0] == pytest.approx(0.5 + 30.0)


def test_synchronous_separation_adds_the_sides():
    # k = 0: generation waits for the weights: 8 + (6 + 2)
    assert price(PLACEMENT, _costs(0))[0] == pytest.approx(0.5 + 16.0)
