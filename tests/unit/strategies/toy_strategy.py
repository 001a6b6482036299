"""A toy strategy, written the way a new one is added: this module plus one registry line
(`tests/unit/strategies/test_registry.py` adds the line). "solo": one process on device 0
holds all four models; it runs the lock-step loop with Flattening's scorer, and is priced
(for `plan` and `auto`) as its phases in turn."""

from __future__ import annotations

from pathlib import Path

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.strategies.base import Overrides, RunResult, Strategy
from rlhf_async.strategies.flattening import full_scorer
from rlhf_async.strategies.lockstep import run_ranks
from rlhf_async.strategies.placement import (
    INFER,
    TRAIN,
    Placement,
    ProcessPlacement,
    engine_problems,
    model_placement,
)
from rlhf_async.strategies.pricing import Pricing, in_turn
from rlhf_async.task.artefacts import Artefacts


def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
    names = ("actor", "critic", "reward", "reference") if recipe.has_critic else \
        ("actor", "reward", "reference")
    models = tuple(model_placement(cfg, m, [0], TRAIN if m in ("actor", "critic") else INFER,
                                   over) for m in names)
    return Placement("solo", cfg.device, cfg.devices,
                     (ProcessPlacement("solo", "worker", names, (0,), TRAIN),), models)


def placement_problems(cfg: PlacementConfig, p: Placement) -> list[str]:
    return [] if cfg.devices == 1 else [f"placement.devices: solo uses one device, got "
                                        f"{cfg.devices}"]


def runner_problems(cfg: JobConfig, p: Placement) -> list[str]:
    return engine_problems(p)


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    return run_ranks(cfg, art, run_dir, start_step, full_scorer, "solo",
                     placement.precision())


STRATEGY = Strategy(name="solo", summary="everything in one process on device 0",
                    roles=("worker",), preset=preset, placement_problems=placement_problems,
                    runner_problems=runner_problems, run=run, pricing=Pricing(step=in_turn))
