"""Flattening: every device holds all four models and runs generate -> score -> train.

One process per device (CPU slot or GPU); each takes its contiguous part of the global batch
and scores it with its own reward and reference copies; gradients are summed over ranks.
With one device the loop runs in the calling process (`lockstep`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.modeling.models import freeze, frozen_copy
from rlhf_async.modeling.precision import Precision
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.scoring import score
from rlhf_async.strategies.base import Overrides, RunResult, Strategy
from rlhf_async.strategies.lockstep import Scorer, run_ranks
from rlhf_async.strategies.placement import (
    INFER,
    TRAIN,
    Placement,
    ProcessPlacement,
    engine_problems,
    model_placement,
)
from rlhf_async.strategies.pricing import Pricing, in_turn
from rlhf_async.task import Task, reward_mix
from rlhf_async.task.artefacts import Artefacts, load_reward
from rlhf_async.task.rewards.teacher import load_teacher


def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
    names = ("actor", "critic", "reward", "reference") if recipe.has_critic else \
        ("actor", "reward", "reference")
    every = list(range(cfg.devices))
    procs = tuple(ProcessPlacement(f"worker{d}", "worker", names, (d,), TRAIN)
                  for d in every)
    models = tuple(model_placement(cfg, m, every,
                                   TRAIN if m in ("actor", "critic") else INFER, over)
                   for m in names)
    return Placement("flattening", cfg.device, cfg.devices, procs, models)


def placement_problems(cfg: PlacementConfig, p: Placement) -> list[str]:
    return []  # every model everywhere: nothing can conflict beyond the shared checks


def runner_problems(cfg: JobConfig, p: Placement) -> list[str]:
    out = engine_problems(p)
    if cfg.train.prompts_per_step % cfg.placement.devices:
        out.append(f"train.prompts_per_step: {cfg.train.prompts_per_step} must divide evenly "
                   f"over placement.devices = {cfg.placement.devices}")
    return out


def full_scorer(cfg: JobConfig, art: Artefacts, task: Task, actor: nn.Module, rank: int,
                world: int, device: torch.device, precision: Precision) -> Scorer:
    """Every rank scores its own rows with its own reward model (or the task's rule reward)
    and reference (a frozen copy of the SFT actor), each held in its dtype."""
    reference = precision.hold("reference", frozen_copy(actor))
    rm = load_reward(art)
    reward_model = None if rm is None else precision.hold("reward", freeze(rm).to(device))
    mix, teacher = reward_mix(cfg, task), load_teacher(cfg, device, precision)

    def scorer(batch: RolloutBatch) -> RolloutBatch:
        return score(reward_model, reference, batch, cfg.generation.temperature, mix,
                     packed=cfg.train.max_tokens_per_microbatch > 0, teacher=teacher)
    return scorer


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    return run_ranks(cfg, art, run_dir, start_step, full_scorer, "flattening",
                     placement.precision())


STRATEGY = Strategy(
    name="flattening", short="flat",
    summary="every model on every device; generate -> score -> train in lock-step",
    roles=("worker",), preset=preset, placement_problems=placement_problems,
    runner_problems=runner_problems, run=run, pricing=Pricing(step=in_turn))
