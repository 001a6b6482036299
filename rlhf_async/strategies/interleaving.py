"""Interleaving: actor (+ critic) on every device, reference and reward on exclusive groups.

One process per device, as in Flattening: each generates and trains on its shard of the
global batch (whole prompt groups; gradients summed over ranks). Scoring differs: the
rollouts are all-gathered, each owner of a frozen model scores its contiguous share of the
global batch with the one model it holds (reference owners and reward owners at the same
time, on their own devices), and an all-reduce of the zero-filled result tensors hands
every rank the scores of its own rows. A rank without a copy of a model never loads it.

    rank:       0          1          2          3
    actor+critic everywhere -> generate own shard
    all_gather rollouts ------------------------------------------
    reference: rows 0..B/2   rows B/2..B  |  reward: rows 0..B/2  rows B/2..B
    all_reduce(rewards, ref_logprobs) -> each rank takes its rows -> train (DDP)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.modeling.models import (
    ScalarHeadModel,
    freeze,
    frozen_copy,
    response_logits,
    sequence_scores,
)
from rlhf_async.modeling.precision import Precision
from rlhf_async.modeling.rollout import RolloutBatch, loss_mask, split_bounds
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.scoring import RewardMix
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
from rlhf_async.strategies.pricing import Pricing, StepCosts, in_turn
from rlhf_async.task import Task, reward_mix
from rlhf_async.task.artefacts import Artefacts, load_reward
from rlhf_async.task.rewards.teacher import load_teacher

GATHERED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


@dataclass(frozen=True)
class Owners:
    """Ranks that hold each frozen model (sorted)."""

    reference: tuple[int, ...]
    reward: tuple[int, ...]

    @classmethod
    def of(cls, p: Placement) -> Owners:
        ref, rw = p.model("reference"), p.model("reward")
        assert ref is not None and rw is not None  # validate() guarantees both
        return cls(ref.devices, rw.devices)


def share(n: int, owners: tuple[int, ...], rank: int) -> slice:
    """Rows of a global batch of `n` that owner `rank` scores (empty for non-owners)."""
    if rank not in owners:
        return slice(0, 0)
    i, k = owners.index(rank), len(owners)
    return slice(i * n // k, (i + 1) * n // k)


def shard_sizes(samples: int, world: int, group_size: int) -> list[int]:
    """Rows each rank holds under `PromptBatch.split` (known to all ranks without a message)."""
    bounds = split_bounds(samples // group_size, world, group_size)
    return [hi - lo for lo, hi in itertools.pairwise(bounds)]


def _gather_rows(t: Tensor, sizes: list[int]) -> Tensor:
    """Concatenate every rank's rows of `t` (row counts `sizes`) in rank order."""
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


@torch.no_grad()
def score_interleaved(batch: RolloutBatch, sizes: list[int], reward_model: ScalarHeadModel | None,
                      reference: nn.Module | None, owners: Owners, temperature: float,
                      mix: RewardMix, rule_reward: bool = False, teacher: nn.Module | None = None,
                      distils: bool = False) -> RolloutBatch:
    """Add rewards [B] and reference log-probs [B, R] to this rank's rows; every rank calls
    it (the same two collectives on all), owners do the forward passes. With `rule_reward`
    (no reward model anywhere) each rank's own rows get their rule scores (`mix`). With
    `distils` the reference's owners also hold the `teacher` and add its log-probs [B, R]."""
    rank = dist.get_rank()
    started = mix.start(batch)  # a reward server's answer comes while the forwards run
    P = batch.prompt_ids.shape[1]
    packed = torch.cat([getattr(batch, k) for k in GATHERED], dim=1)  # [B, 2P + 2R]
    full = _gather_rows(packed, sizes)  # [N, 2P + 2R]: one collective for all four
    R = (full.shape[1] - 2 * P) // 2
    cols = {"prompt_ids": (0, P), "prompt_mask": (P, 2 * P),
            "response_ids": (2 * P, 2 * P + R), "response_mask": (2 * P + R, 2 * P + 2 * R)}
    n = full.shape[0]
    # [N, 1 + R (+ R)]: reward | ref log-probs (| teacher's), on the rows' device (NCCL
    # reduces device tensors)
    both = torch.zeros((n, 1 + R * (2 if distils else 1)), dtype=torch.float32,
                       device=full.device)
    rows = share(n, owners.reward, rank)
    if reward_model is not None and rows.stop > rows.start:
        args = [full[rows, a:b] for a, b in cols.values()]
        both[rows, 0] = sequence_scores(reward_model, *args).float()
    rows = share(n, owners.reference, rank)
    if reference is not None and rows.stop > rows.start:
        args = [full[rows, a:b] for a, b in cols.values()]
        logits = response_logits(reference, *args).float()  # [n_i, R, V]
        both[rows, 1:1 + R] = A.gather_logprobs(logits, args[2], temperature) * \
            loss_mask(args[3])
        if teacher is not None:
            logits = response_logits(teacher, *args).float()  # [n_i, R, V]
            both[rows, 1 + R:] = A.gather_logprobs(logits, args[2], temperature) * \
                loss_mask(args[3])
    # exactly one owner wrote each entry, so summing zeros is exact
    dist.all_reduce(both, op=dist.ReduceOp.SUM)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    rewards, hidden = mix.combine(None if rule_reward else both[mine, 0], batch, started)
    return batch.replace(rewards=rewards.contiguous(),
                         ref_logprobs=both[mine, 1:1 + R].contiguous(), hidden_scores=hidden,
                         teacher_logprobs=both[mine, 1 + R:].contiguous() if distils else None)


@dataclass(frozen=True)
class InterleavedScorer:
    """Builds a rank's scorer: it loads only the frozen models it owns (a rank without a
    copy never loads it), in the dtype the placement gives them."""

    owners: Owners

    def __call__(self, cfg: JobConfig, art: Artefacts, task: Task, actor: nn.Module,
                 rank: int, world: int, device: torch.device, precision: Precision) -> Scorer:
        o = self.owners
        reference = precision.hold("reference", frozen_copy(actor)) \
            if rank in o.reference else None
        teacher = load_teacher(cfg, device, precision) if rank in o.reference else None
        trained_rm = load_reward(art) if rank in o.reward else None  # None: a rule reward
        reward_model = precision.hold("reward", freeze(trained_rm).to(device)) \
            if trained_rm is not None else None
        G, mix = cfg.algo.group_size, reward_mix(cfg, task)
        sizes = shard_sizes(cfg.train.prompts_per_step * G, world, G)

        def scorer(batch: RolloutBatch) -> RolloutBatch:
            return score_interleaved(batch, sizes, reward_model, reference, o,
                                     cfg.generation.temperature, mix, task.rule_reward,
                                     teacher, bool(cfg.teacher.path))
        return scorer


def _halves(n: int) -> tuple[list[int], list[int]]:
    """Reference on the first part, reward on the rest (the first gets the odd device)."""
    cut = max(1, (n + 1) // 2)
    return list(range(cut)), list(range(cut, n)) or [0]


def preset(cfg: PlacementConfig, recipe: Recipe, over: Overrides) -> Placement:
    """Actor (+ critic) on every device; reference and reward on exclusive device groups,
    so they score concurrently; a worker without a copy hands its rows to an owner."""
    n = cfg.devices
    ref_default, rw_default = _halves(n)
    groups = {"actor": cfg.actor or list(range(n)), "critic": cfg.critic or list(range(n)),
              "reference": cfg.reference or ref_default, "reward": cfg.reward or rw_default}
    if not recipe.has_critic:
        del groups["critic"]
    models = tuple(model_placement(cfg, m, sorted(devs),
                                   TRAIN if m in ("actor", "critic") else INFER, over)
                   for m, devs in groups.items())
    procs = []
    for d in range(n):
        here = tuple(m for m, devs in groups.items() if d in devs)
        runtime = TRAIN if {"actor", "critic"} & set(here) else INFER
        procs.append(ProcessPlacement(f"worker{d}", "worker", here, (d,), runtime))
    return Placement("interleaving", cfg.device, n, tuple(procs), models)


def placement_problems(cfg: PlacementConfig, p: Placement) -> list[str]:
    if cfg.devices < 2:
        return ["placement.devices: interleaving needs >= 2 devices (reference and reward "
                "on exclusive groups); use flattening on one device"]
    ref, rw = p.model("reference"), p.model("reward")
    shared = sorted(set(ref.devices) & set(rw.devices)) if ref and rw else []
    if shared:
        return [f"placement.reward: devices {shared} also hold the reference; "
                "interleaving puts them on exclusive groups so they score concurrently"]
    return []


def runner_problems(cfg: JobConfig, p: Placement) -> list[str]:
    """One replica per device of a group."""
    problems = engine_problems(p)
    if cfg.placement.device != "cpu":
        problems.append("placement.device: this build runs interleaving on cpu only")
    if cfg.train.prompts_per_step < cfg.placement.devices:
        problems.append(f"train.prompts_per_step: {cfg.train.prompts_per_step} prompts cannot "
                        f"be shared by {cfg.placement.devices} devices; needs >= devices")
    return problems


def run(cfg: JobConfig, placement: Placement, art: Artefacts, run_dir: Path,
        start_step: int = 0) -> RunResult:
    """The RL phase over `placement.devices` (>= 2) rank processes from `start_step`."""
    return run_ranks(cfg, art, run_dir, start_step, InterleavedScorer(Owners.of(placement)),
                     "interleaving", placement.precision())


def price(p: Placement, costs: StepCosts) -> tuple[float, dict[str, float]]:
    """In turn, with every rank's rollouts gathered for the owners and their scores
    reduced back between scoring and training."""
    return in_turn(p, costs, exchange=True)


STRATEGY = Strategy(
    name="interleaving", short="inter",
    summary="actor (+ critic) everywhere; reward and reference on exclusive device groups",
    roles=("worker",), preset=preset, placement_problems=placement_problems,
    runner_problems=runner_problems, run=run, pricing=Pricing(step=price))
