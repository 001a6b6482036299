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

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from rlhf_async import algorithms as A
from rlhf_async.checkpoint import (
    CheckpointError,
    load_latest,
    restore_learner,
)
from rlhf_async.config import JobConfig
from rlhf_async.flattening import end_step, finish, sampling_params
from rlhf_async.metrics import MetricsWriter, Progress
from rlhf_async.models import (
    ScalarHeadModel,
    frozen_copy,
    response_logits,
    sequence_scores,
)
from rlhf_async.placement import (
    Placement,
    PlacementError,
    plan_placement,
    runner_problems,
    with_engines,
)
from rlhf_async.process_group import exit_rank, free_port, rank_group
from rlhf_async.roles import Learner, generate
from rlhf_async.rollout import PromptBatch, RolloutBatch
from rlhf_async.task import make_task
from rlhf_async.task.pretrain import Artefacts, load_critic, load_reward, load_sft

M = TypeVar("M", bound=nn.Module)
HiddenScore = Callable[[Tensor, Tensor, Tensor], Tensor]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GATHERED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


@dataclass
class InterleavingResult:
    metrics_path: Path
    policy_dir: Path
    seconds: float


@dataclass(frozen=True)
class Owners:
    """Ranks that hold each frozen model (sorted), and its dtype."""

    reference: tuple[int, ...]
    reward: tuple[int, ...]
    reference_dtype: str = "fp32"
    reward_dtype: str = "fp32"

    @classmethod
    def of(cls, p: Placement) -> Owners:
        ref, rw = p.model("reference"), p.model("reward")
        assert ref is not None and rw is not None  # validate() guarantees both
        return cls(ref.devices, rw.devices, ref.dtype, rw.dtype)


def shard_prompts(prompts: PromptBatch, rank: int, world: int, group_size: int) -> PromptBatch:
    """Rank's contiguous share of whole prompt groups; any world size <= prompt count."""
    groups = len(prompts) // group_size
    lo, hi = rank * groups // world, (rank + 1) * groups // world
    s = slice(lo * group_size, hi * group_size)
    return PromptBatch(prompts.prompt_ids[s], prompts.prompt_mask[s], prompts.sample_ids[s],
                       prompts.group_ids[s])


def share(n: int, owners: tuple[int, ...], rank: int) -> slice:
    """Rows of a global batch of `n` that owner `rank` scores (empty for non-owners)."""
    if rank not in owners:
        return slice(0, 0)
    i, k = owners.index(rank), len(owners)
    return slice(i * n // k, (i + 1) * n // k)


def shard_sizes(samples: int, world: int, group_size: int) -> list[int]:
    """Rows each rank holds under `shard_prompts` (known to all ranks without a message)."""
    groups = samples // group_size
    return [((r + 1) * groups // world - r * groups // world) * group_size
            for r in range(world)]


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
                      hidden_score: HiddenScore | None = None,
                      rule_reward: bool = False) -> RolloutBatch:
    """Add rewards [B] and reference log-probs [B, R] to this rank's rows; every rank calls
    it (the same two collectives on all), owners do the forward passes. With `rule_reward`
    the hidden score of each rank's own rows is its reward (no reward model anywhere)."""
    rank = dist.get_rank()
    P = batch.prompt_ids.shape[1]
    packed = torch.cat([getattr(batch, k) for k in GATHERED], dim=1)  # [B, 2P + 2R]
    full = _gather_rows(packed, sizes)  # [N, 2P + 2R]: one collective for all four
    R = (full.shape[1] - 2 * P) // 2
    cols = {"prompt_ids": (0, P), "prompt_mask": (P, 2 * P),
            "response_ids": (2 * P, 2 * P + R), "response_mask": (2 * P + R, 2 * P + 2 * R)}
    n = full.shape[0]
    both = torch.zeros((n, 1 + R), dtype=torch.float32)  # [N, 1 + R]: reward | ref log-probs
    rows = share(n, owners.reward, rank)
    if reward_model is not None and rows.stop > rows.start:
        args = [full[rows, a:b] for a, b in cols.values()]
        both[rows, 0] = sequence_scores(reward_model, *args).float()
    rows = share(n, owners.reference, rank)
    if reference is not None and rows.stop > rows.start:
        args = [full[rows, a:b] for a, b in cols.values()]
        logits = response_logits(reference, *args).float()  # [n_i, R, V]
        both[rows, 1:] = A.gather_logprobs(logits, args[2], temperature) * args[3]
    # exactly one owner wrote each entry, so summing zeros is exact
    dist.all_reduce(both, op=dist.ReduceOp.SUM)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    hidden = None
    if hidden_score is not None:
        hidden = hidden_score(batch.prompt_ids, batch.response_ids, batch.response_mask)
    if rule_reward:
        assert hidden is not None, "a rule reward is the task's hidden score"
        both[mine, 0] = hidden
    return batch.replace(rewards=both[mine, 0].contiguous(),
                         ref_logprobs=both[mine, 1:].contiguous(), hidden_scores=hidden)


def _frozen(model: M, dtype: str) -> M:
    return frozen_copy(model).to(DTYPES[dtype])  # type: ignore[return-value]  # same class


def rl_loop(cfg: JobConfig, art: Artefacts, run_dir: Path, owners: Owners, rank: int,
            world: int, start_step: int = 0) -> None:
    """The interleaved hot loop; identical on every rank except what each holds and who
    writes files."""
    task = make_task(cfg)
    actor = load_sft(art.sft_dir)
    reference = _frozen(actor, owners.reference_dtype) if rank in owners.reference else None
    trained_rm = load_reward(art) if rank in owners.reward else None  # None: a rule reward
    reward_model = _frozen(trained_rm, owners.reward_dtype) if trained_rm is not None else None
    learner = Learner(actor, load_critic(cfg, art), cfg.algo, cfg.train, cfg.run.seed,
                      cfg.generation.temperature)
    params, seed, T = sampling_params(cfg, task), cfg.run.seed, cfg.generation.temperature
    if start_step:  # every rank restores the same checkpoint
        ck = load_latest(run_dir / "checkpoints")
        if ck is None or ck.step != start_step:
            raise CheckpointError(f"rank {rank}: checkpoint of step {start_step} not found")
        restore_learner(learner, ck.state)
    writer = MetricsWriter(run_dir / "metrics.jsonl") if rank == 0 else None
    progress = Progress(cfg.train.steps, cfg.run.progress and rank == 0)
    G = cfg.algo.group_size
    sizes = shard_sizes(cfg.train.prompts_per_step * G, world, G)
    for step in range(start_step, cfg.train.steps):
        prompts = shard_prompts(task.prompt_batch(seed, "train", step, cfg.train.prompts_per_step,
                                                  G), rank, world, G)
        t0 = time.perf_counter()
        batch = generate(actor, prompts, params, seed, step, learner.version)
        t1 = time.perf_counter()
        batch = score_interleaved(batch, sizes, reward_model, reference, owners, T,
                                  task.hidden_scores, task.rule_reward)
        t2 = time.perf_counter()
        metrics = learner.train_step(batch)
        t3 = time.perf_counter()
        end_step(cfg, learner, run_dir, writer, progress, step, metrics, (t0, t1, t2, t3),
                 "interleaving")
    finish(cfg, learner, run_dir, writer)


def _worker(rank: int, world: int, port: int, cfg: JobConfig, art: Artefacts, run_dir: Path,
            owners: Owners, start_step: int) -> None:
    torch.set_num_threads(cfg.placement.cpu_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with rank_group("gloo", port, rank, world):
        rl_loop(cfg, art, run_dir, owners, rank, world, start_step)
    exit_rank()


def interleaving_placement(cfg: JobConfig) -> Placement:
    """The validated placement, including what this build's runner cannot execute."""
    placement = with_engines(plan_placement(cfg.placement, cfg.algo.name), cfg.train.backend,
                             cfg.generation.backend)
    problems = runner_problems(placement)
    if cfg.placement.device != "cpu":
        problems.append("placement.device: this build runs interleaving on cpu only")
    if cfg.train.prompts_per_step < cfg.placement.devices:
        problems.append(f"train.prompts_per_step: {cfg.train.prompts_per_step} prompts cannot "
                        f"be shared by {cfg.placement.devices} devices; needs >= devices")
    if problems:
        raise PlacementError(problems)
    return placement


def run_interleaving(cfg: JobConfig, art: Artefacts, run_dir: Path,
                     start_step: int = 0) -> InterleavingResult:
    """Run the RL phase over `placement.devices` (>= 2) processes from `start_step`."""
    placement = interleaving_placement(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "placement.txt").write_text(placement.table() + "\n")
    world = cfg.placement.devices
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(world, free_port(), cfg, art, run_dir, Owners.of(placement),
                            start_step), nprocs=world, join=True)
    return InterleavingResult(run_dir / "metrics.jsonl", run_dir / "policy",
                              time.perf_counter() - t0)
