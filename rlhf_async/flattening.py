"""Flattening: every device holds all four models and runs generate -> score -> train.

One process per device (CPU slot or GPU); each takes its contiguous shard of the global
batch; gradients are summed over ranks (gloo on CPU, NCCL on GPU). With one device the
loop runs in the calling process. Rank 0 writes metrics.jsonl and the final policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rlhf_async.checkpoint import (
    CheckpointError,
    learner_state,
    load_latest,
    restore_learner,
    save_checkpoint,
)
from rlhf_async.config import JobConfig
from rlhf_async.generation import SamplingParams
from rlhf_async.metrics import MetricsWriter, Progress
from rlhf_async.models import M, frozen_copy, save_policy
from rlhf_async.process_group import exit_rank, free_port, rank_group
from rlhf_async.roles import Learner, generate, score
from rlhf_async.task import Task, make_task
from rlhf_async.task.pretrain import Artefacts, load_critic, load_reward, load_sft


@dataclass
class FlatteningResult:
    metrics_path: Path
    policy_dir: Path
    seconds: float


def sampling_params(cfg: JobConfig, task: Task) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(g.max_new_tokens, task.eos_id, task.pad_id, g.temperature, g.top_k)


def _device(cfg: JobConfig, rank: int) -> torch.device:
    if cfg.placement.device == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def rl_loop(cfg: JobConfig, art: Artefacts, run_dir: Path, rank: int, world: int,
            start_step: int = 0) -> None:
    """The flattened hot loop; identical on every rank except who writes files."""
    device = _device(cfg, rank)
    task = make_task(cfg)
    actor = load_sft(art.sft_dir).to(device)
    reference = frozen_copy(actor)
    reward_model = _frozen_to(load_reward(art), device)  # None: the task's rule reward
    critic = load_critic(cfg, art)
    critic = critic.to(device) if critic is not None else None
    learner = Learner(actor, critic, cfg.algo, cfg.train, cfg.run.seed,
                      cfg.generation.temperature)
    params, seed, T = sampling_params(cfg, task), cfg.run.seed, cfg.generation.temperature
    if start_step:  # every rank restores the same checkpoint
        ck = load_latest(run_dir / "checkpoints", map_location=device)
        if ck is None or ck.step != start_step:
            raise CheckpointError(f"rank {rank}: checkpoint of step {start_step} not found")
        restore_learner(learner, ck.state)
    writer = MetricsWriter(run_dir / "metrics.jsonl") if rank == 0 else None
    progress = Progress(cfg.train.steps, cfg.run.progress and rank == 0)
    for step in range(start_step, cfg.train.steps):
        prompts = task.prompt_batch(seed, "train", step, cfg.train.prompts_per_step,
                                    cfg.algo.group_size).shard(rank, world).to(device)
        t0 = time.perf_counter()
        batch = generate(actor, prompts, params, seed, step, learner.version)
        t1 = time.perf_counter()
        batch = score(reward_model, reference, batch, T, task.hidden_scores)
        t2 = time.perf_counter()
        metrics = learner.train_step(batch)
        t3 = time.perf_counter()
        end_step(cfg, learner, run_dir, writer, progress, step, metrics, (t0, t1, t2, t3),
                 "flattening")
    finish(cfg, learner, run_dir, writer)


def _frozen_to(model: M | None, device: torch.device) -> M | None:
    return None if model is None else frozen_copy(model).to(device)


def end_step(cfg: JobConfig, learner: Learner, run_dir: Path, writer: MetricsWriter | None,
             progress: Progress, step: int, metrics: dict, times: tuple[float, ...],
             strategy: str) -> None:
    """Metrics line, then (when due) the checkpoint that includes the step. Every rank
    calls it: gathering the learner state is collective under ZeRO."""
    t0, t1, t2, t3 = times
    every = cfg.run.checkpoint_every
    due = every and (step + 1) % every == 0 and step + 1 < cfg.train.steps
    state = learner_state(learner) if due else None
    if writer is None:
        return
    record = {"step": step, **metrics, "time_generate": t1 - t0, "time_score": t2 - t1,
              "time_train": t3 - t2, "samples_per_s": metrics["samples"] / (t3 - t0)}
    writer.write(record)  # before the checkpoint that includes the step
    progress.update(record)
    if state is not None:
        save_checkpoint(run_dir / "checkpoints", step + 1, state,
                        {"version": learner.version, "strategy": strategy},
                        cfg.run.keep_checkpoints)


def finish(cfg: JobConfig, learner: Learner, run_dir: Path, writer: MetricsWriter | None) -> None:
    """Rank 0 saves the final policy; every rank joins the gather and closes its engines."""
    with learner.actor_backend.gathered():  # full weights even under ZeRO-3 (collective)
        if writer is not None:
            writer.close()
            save_policy(learner.actor, run_dir / "policy", {"algo": cfg.algo.name,
                                                            "steps": cfg.train.steps,
                                                            "version": learner.version})
    learner.close()


def _worker(rank: int, world: int, port: int, threads: int, cfg: JobConfig, art: Artefacts,
            run_dir: Path, start_step: int) -> None:
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    backend = "nccl" if cfg.placement.device == "cuda" else "gloo"
    with rank_group(backend, port, rank, world):
        rl_loop(cfg, art, run_dir, rank, world, start_step)
    exit_rank()


def run_flattening(cfg: JobConfig, art: Artefacts, run_dir: Path,
                   start_step: int = 0) -> FlatteningResult:
    """Run the RL phase over `placement.devices` processes (in-process when 1), from
    `start_step` (restored from that step's checkpoint)."""
    world = cfg.placement.devices
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if world == 1:
        rl_loop(cfg, art, run_dir, 0, 1, start_step)
    else:
        mp.spawn(_worker, args=(world, free_port(), cfg.placement.cpu_threads, cfg, art, run_dir,
                               start_step),
                 nprocs=world, join=True)
    return FlatteningResult(run_dir / "metrics.jsonl", run_dir / "policy",
                            time.perf_counter() - t0)
