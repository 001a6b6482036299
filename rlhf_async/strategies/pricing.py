"""How a strategy prices itself for the planner (`rlhf-async plan`, `auto`).

The cost model (planning/costmodel.py) prices what every placement has: each phase's
seconds on its busiest device (`StepCosts`). How those phases make one step is the
strategy's (`Pricing.step`): in turn (the lock-step strategies, `in_turn`), or overlapped
in a pipeline (Separation). Which layouts of a config are worth comparing is the
strategy's too: `layouts` for `auto` (Separation's stage sizes), `grid` for `plan
--simulate` on a bare cluster. A new strategy gives its `Pricing` in its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlhf_async.config import PlacementConfig
from rlhf_async.strategies.placement import Placement


@dataclass(frozen=True)
class StepCosts:
    """One step of a placement as the cost model prices it: each phase's seconds on its
    busiest device, what moving data between the phases costs, and the calibration's
    factors a strategy applies as it overlaps them."""

    generate: float
    score: float
    train: float
    sync: float  # one broadcast of the actor's weights to the shadow actors (0 without)
    exchange: float  # all-gather a step's rollouts and all-reduce their scores, all devices
    slowdown: float  # each device's slowdown while several are busy (>= 1)
    pipeline_s: float  # per step, a pipeline's queues and control plane
    max_staleness: int

    def phases(self) -> dict[str, float]:
        return {"generate": self.generate, "score": self.score, "train": self.train,
                "sync": self.sync}


# -> (step seconds before the job loop's fixed cost, the phases as the strategy runs them)
StepPrice = Callable[[Placement, StepCosts], tuple[float, dict[str, float]]]


def no_layouts(cfg: PlacementConfig) -> list[PlacementConfig]:
    """The preset is the only layout."""
    return []


@dataclass(frozen=True)
class Pricing:
    step: StepPrice
    # other layouts of a config `auto` prices (the fastest runnable one wins); none: the preset
    layouts: Callable[[PlacementConfig], list[PlacementConfig]] = no_layouts
    # layouts `plan --simulate` prices on a bare cluster (`cfg`: the strategy on n GPUs)
    grid: Callable[[PlacementConfig], list[PlacementConfig]] = no_layouts


def in_turn(p: Placement, c: StepCosts, exchange: bool = False) -> tuple[float, dict[str, float]]:
    """Generate, score and train one after another on every device (with `exchange`, the
    rollouts gathered and the scores reduced between scoring and training)."""
    phases = c.phases()
    if exchange:
        phases["score"] += c.exchange
    if p.num_devices > 1:
        phases = {k: v * c.slowdown for k, v in phases.items()}
    return phases["generate"] + phases["score"] + phases["train"], phases
