"""Held-out evaluation of a policy: before RL, every `run.eval_every` steps during it, and
after it; and the best policy so far (`run.keep_best`).

One evaluation everywhere: the same held-out prompts (`run.eval_prompts` of the task's
'eval' split), sampled with noise keyed by step EVAL_STEP, which is never a training step,
so evaluating mid-run leaves the training trajectory exactly as it was, and every
evaluation of a run samples with the same noise (a policy's scores are comparable across
steps). Scored by the reward model (`load_reward`) and the task's rule as training scores
(`reward_mix`).

Where it runs during RL: on the process that holds a whole actor and the run's artefacts:
rank 0 of the lock-step loop (`strategies/lockstep.py`), trainer rank 0 under Separation
(`nodes/trainer/main.py`). It loads its own reward model there (one more copy on that device).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlhf_async.config import JobConfig
from rlhf_async.log import get_logger
from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.models import ScalarHeadModel, save_policy, sequence_scores
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.progress import Phase
from rlhf_async.rl.learner import Learner
from rlhf_async.task import Task, reward_mix, sampling_params
from rlhf_async.task.artefacts import Artefacts, load_reward
from rlhf_async.task.samples import SamplesLog

log = get_logger(component="evaluation")
EVAL_STEP = -1  # key of the evaluation sampling noise; never a training step
BEST_DIR = "best"  # RUN_DIR/best: the best policy so far (run.keep_best)
BEST_META = "rlhf_async.json"  # save_policy's metadata file


@torch.no_grad()
def evaluate(actor: torch.nn.Module, reward_model: ScalarHeadModel | None, task: Task,
             cfg: JobConfig, label: str = "policy", show: bool = True) -> dict[str, float]:
    """Sampled responses on held-out prompts (`run.eval_samples` each, averaged): hidden
    score, reward (the reward model's score, or the rule reward when there is no reward
    model), length. `show`: a progress bar (when `run.progress`)."""
    k = cfg.run.eval_samples
    prompts = task.prompt_batch(cfg.run.seed, "eval", 0, cfg.run.eval_prompts, k)
    device = next(actor.parameters()).device
    with Phase(f"eval {label}", len(prompts), enabled=cfg.run.progress and show,
               unit="sample") as bar:
        # one batch: the evaluation is the same whatever the progress display
        b = rollout(actor, prompts.to(device), sampling_params(cfg, task), cfg.run.seed,
                     EVAL_STEP, 0)
        b = b.select(b.episode_index())  # an agent's earlier segments are not episodes
        args = (b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
        rm = None if reward_model is None else sequence_scores(reward_model, *args)
        reward, hidden = reward_mix(cfg, task).combine(rm, b)
        # the hidden score is a column only beside a reward model's reward (else it is the
        # reward itself, or nothing: an agent's or an environment's task has no rule)
        shown = {"hidden": float(hidden.mean())} if rm is not None and task.has_rule else {}
        bar.update(len(b), **shown, reward=float(reward.mean()))
    return {"hidden_score": float(hidden.mean()),
            "reward": float(reward.mean()),
            "response_length": float(b.loss_mask.sum(1).mean()),  # the policy's tokens
            "prompts": len(b) // k, "samples": len(b)}


def best_metric(cfg: JobConfig, task: Task) -> str:
    """What `run.keep_best` ranks by (higher is better): `run.best_metric`, else the hidden
    score where the task has one, else the reward."""
    return cfg.run.best_metric or ("hidden_score" if task.has_rule else "reward")


# (the directory to save the policy in, its metadata) -> None
SavePolicy = Callable[[Path, dict], None]


class HeldoutEval:
    """`run.eval_every`: evaluates the policy after every N-th step; with `run.keep_best`
    keeps the best policy so far in RUN_DIR/best (a policy directory like RUN_DIR/policy,
    its step and score in best/rlhf_async.json). A resumed run keeps a best from before its
    checkpoint, and drops one from the steps it trains again."""

    def __init__(self, cfg: JobConfig, task: Task, art: Artefacts, run_dir: Path,
                 start_step: int, device: torch.device) -> None:
        self.cfg, self.task, self.every = cfg, task, cfg.run.eval_every
        self.metric = best_metric(cfg, task)
        self.best_dir = run_dir / BEST_DIR
        self.best = _read_best(self.best_dir, start_step) if cfg.run.keep_best else None
        rm = load_reward(art) if self.every else None
        self.reward_model = None if rm is None else rm.to(device)

    def due(self, step: int) -> bool:
        return bool(self.every) and (step + 1) % self.every == 0

    def __call__(self, step: int, actor: torch.nn.Module, save: SavePolicy) -> dict[str, float]:
        """Evaluate after step `step`; -> the step record's eval_* fields (eval_best = 1.0
        when this policy is the new best and was kept)."""
        scores = evaluate(actor, self.reward_model, self.task, self.cfg, show=False)
        out = {f"eval_{k}": float(v) for k, v in scores.items()}
        value = scores[self.metric]
        if self.cfg.run.keep_best and (self.best is None or value > self.best):
            self._keep(step, value, save)
            out["eval_best"] = 1.0
        return out

    def _keep(self, step: int, value: float, save: SavePolicy) -> None:
        """Write the new best beside the old one, then swap: a crash leaves one whole."""
        tmp = self.best_dir.with_name(f".{BEST_DIR}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp, {"step": step, "metric": self.metric, "value": value,
                   "algo": self.cfg.algo.name})
        old = self.best_dir.with_name(f".{BEST_DIR}.old")
        shutil.rmtree(old, ignore_errors=True)
        if self.best_dir.exists():
            os.replace(self.best_dir, old)
        os.replace(tmp, self.best_dir)
        shutil.rmtree(old, ignore_errors=True)
        self.best = value
        log.info("best_policy_kept", step=step, metric=self.metric, value=value,
                 path=str(self.best_dir))


def learner_saver(learner: Learner) -> SavePolicy:
    """Saves the learner's policy as the final one is saved (merged LoRA weights
    included), with its weight version in the metadata."""
    def save(path: Path, meta: dict) -> None:
        save_policy(learner.actor, path, {**meta, "version": learner.version},  # type: ignore[arg-type]
                    learner.policy_weights())
    return save


class StepLogs:
    """What the training process records after each step besides the metrics: the step's
    samples (samples.jsonl) and, when due, the held-out evaluation (its eval_* fields go
    into the step's metrics record). One call per step from each runner."""

    def __init__(self, cfg: JobConfig, task: Task, art: Artefacts, run_dir: Path,
                 start_step: int, device: torch.device) -> None:
        self.samples = SamplesLog(run_dir, cfg.run.log_samples, task, start_step)
        self.evals = HeldoutEval(cfg, task, art, run_dir, start_step, device) \
            if cfg.run.eval_every else None

    def after_step(self, step: int, batch: RolloutBatch, learner: Learner) -> dict[str, float]:
        """`batch`: the step's scored batch (its first rows are `learner`'s shard)."""
        self.samples.write(step, batch, learner.last_advantages)
        if self.evals is None or not self.evals.due(step):
            return {}
        t0 = time.perf_counter()
        out = self.evals(step, learner.actor, learner_saver(learner))
        return {**out, "time_eval": time.perf_counter() - t0}

    def close(self) -> None:
        self.samples.close()


def _read_best(best_dir: Path, start_step: int) -> float | None:
    """The kept best's score; None (and the directory removed) when there is none or it
    comes from a step at or after `start_step` (a resumed run trains those again)."""
    try:
        meta = json.loads((best_dir / BEST_META).read_text())
    except (OSError, ValueError):
        return None
    if int(meta.get("step", start_step)) >= start_step:
        shutil.rmtree(best_dir, ignore_errors=True)
        return None
    return float(meta["value"])
