"""What every strategy's trainer does the same way: build the `Learner`, restore it from a
checkpoint, write one, save the final policy, and shape one step's metrics record. The
lock-step ranks (strategies/lockstep.py) and the Separation trainer node
(nodes/trainer/main.py) both use these.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_async.config import JobConfig
from rlhf_async.modeling.flops import Utilization
from rlhf_async.modeling.models import save_policy
from rlhf_async.modeling.precision import Precision
from rlhf_async.rl.checkpoint import (
    Checkpoint,
    CheckpointError,
    learner_state,
    load_shared,
    restore_learner,
    save_checkpoint,
)
from rlhf_async.rl.learner import Learner
from rlhf_async.task.artefacts import Artefacts, load_critic, load_sft


def load_actor(art: Artefacts, device: torch.device) -> nn.Module:
    """The SFT policy the actor starts from, on `device`."""
    return load_sft(art.sft_dir).to(device)  # type: ignore[arg-type]  # HF's .to overloads


def build_learner(cfg: JobConfig, art: Artefacts, device: torch.device, precision: Precision,
                  actor: nn.Module | None = None) -> Learner:
    """The actor (`actor`, or the SFT policy loaded here) and critic with their optimizers."""
    critic = load_critic(cfg, art)
    return Learner(actor if actor is not None else load_actor(art, device),
                   critic.to(device) if critic is not None else None, cfg.algo, cfg.train,
                   cfg.run.seed, cfg.generation.temperature, precision, cfg.lora)


def restore_learner_checkpoint(learner: Learner, root: Path, rank: int, world: int,
                               device: torch.device, share: bool,
                               step: int | None = None) -> Checkpoint | None:
    """Restore `learner` from the newest good checkpoint under `root` (None when there is
    none), or from the one of `step`, which must be the newest. Every rank calls it; with
    `share` rank 0 reads it and hands it to the others (`load_shared`), so all restore the
    same one."""
    ck = load_shared(root, rank, world, device, share)
    if step is not None and (ck is None or ck.step != step):
        raise CheckpointError(f"rank {rank}: checkpoint of step {step} not found")
    if ck is not None:
        restore_learner(learner, ck.state)
    return ck


def save_learner_checkpoint(cfg: JobConfig, learner: Learner, root: Path, step: int,
                            strategy: str, *, writes: bool = True,
                            meta: Mapping[str, Any] | None = None) -> None:
    """Every rank calls it (gathering the learner state is collective under ZeRO); the
    rank that `writes` saves checkpoint `step` under `root`, with `meta` beside the
    learner's version and the strategy."""
    state = learner_state(learner)
    if writes:
        save_checkpoint(root, step, state, {"version": learner.version, "strategy": strategy,
                                            **(meta or {})}, cfg.run.keep_checkpoints)


def save_final_policy(cfg: JobConfig, learner: Learner, policy_dir: Path, strategy: str,
                      *, writes: bool = True) -> None:
    """Every rank joins the gather of the full weights (ZeRO-3: collective); the rank that
    `writes` saves them, merged (LoRA), as the run's policy."""
    with learner.actor_backend.gathered():
        if writes:
            save_policy(learner.actor, policy_dir,  # type: ignore[arg-type]
                        {"algo": cfg.algo.name, "steps": cfg.train.steps,
                         "version": learner.version, "strategy": strategy},
                        learner.policy_weights())


def step_record(step: int, metrics: Mapping[str, float], time_step: float,
                utilization: Utilization | None = None, busy: Mapping[str, float] | None = None,
                **parts: Any) -> dict[str, Any]:
    """One line of metrics.jsonl. Every strategy writes the step, the learner's metrics,
    the step's wall time and its throughput (samples trained on: a failed episode's row
    has nothing to train); `parts` are the strategy's own (phase times, queues, weight
    sync). With `utilization`: `mfu/*` and tokens/s per device, each stage's FLOPs over
    its `busy` device-seconds (modeling/flops.py)."""
    trained = metrics.get("trained_samples", metrics["samples"])
    record = {"step": step, **metrics, "time_step": time_step,
              "samples_per_s": trained / time_step, **parts}
    if utilization is not None:
        record.update(utilization.of(record, busy or {}))
    return record
