"""Rules over each trained step's metrics that every strategy applies alike: the lock-step
ranks (`lockstep.py`, each rank on the same globally reduced metrics, so all stop
together) and Separation's Driver (`separation/driver.py`, on the trainer's reports).

- A step whose every episode failed or timed out (an agent that raised, returned no
  reward, never called the policy or hung; an environment that timed out) trained on
  nothing: its record says so (`failed_steps`: such steps in a row so far) and a warning
  names it. `run.max_failed_steps` of them in a row end the run: `failure` is set, the
  caller writes a checkpoint and raises it (`NothingTrained`, naming the first episode
  error and the episodes by how they ended, and `rlhf-async resume`).
- A policy that collapsed (a KL far above `algo.kl_target`, or every response at the
  length limit after a step whose responses ended): one warning naming `train.lr`, the
  usual cause.

A reward function or reward server that raises stops the run at its first failure
(`RewardFunctionError`), so reward failures never reach a step record.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig
from rlhf_async.log import get_logger
from rlhf_async.modeling.episodes import ENDS
from rlhf_async.rl.checkpoint import resume_hint
from rlhf_async.strategies.base import UserCodeFailed

log = get_logger(component="health")
KL_FAR = 5.0  # a step's KL this many times algo.kl_target: the policy left the reference
FAILED = ("failed", "timeout")  # the ends that leave an episode nothing to train on


class NothingTrained(UserCodeFailed):
    """`run.max_failed_steps` steps in a row had every episode fail: the run trained on
    nothing, and going on would only repeat it."""


def episode_ends(record: Mapping[str, Any]) -> dict[str, int]:
    """How many of a step's episodes ended each way (`ENDS`; none for single-turn tasks)."""
    return {how: int(record.get(f"episodes/{how}", 0)) for how in ENDS}


def trained_nothing(record: Mapping[str, Any]) -> bool:
    """Every episode of the step failed or timed out (and it had episodes)."""
    ends = episode_ends(record)
    return sum(ends.values()) > 0 and sum(ends[k] for k in FAILED) == sum(ends.values())


class StepHealth:
    """The rules above over one run's steps, in order (`observe` once per trained step)."""

    def __init__(self, cfg: JobConfig, run_dir: Path, logs: bool = True) -> None:
        self.max_failed, self.run_dir, self.logs = cfg.run.max_failed_steps, run_dir, logs
        self.kl_target, self.lr = cfg.algo.kl_target, cfg.train.lr
        self.max_new_tokens = cfg.generation.max_new_tokens
        self.streak: list[int] = []  # the failed steps in a row so far
        self.ends = dict.fromkeys(ENDS, 0)  # their episodes, by how they ended
        self.error = ""  # the first episode error among them
        self.failure: NothingTrained | None = None  # set once, when the run must stop
        self.warned = False
        self.ended = False  # a step whose responses did not all run out of tokens

    def observe(self, step: int, metrics: Mapping[str, Any],
                episode_error: str = "") -> dict[str, int]:
        """Apply the rules to step `step`'s metrics (`episode_error`: the first of its
        episodes' errors, where known); what its record adds (`failed_steps`)."""
        self._collapse(step, metrics)
        if not trained_nothing(metrics):
            self.streak, self.ends, self.error = [], dict.fromkeys(ENDS, 0), ""
            return {"failed_steps": 0}
        self.streak.append(step)
        ends = episode_ends(metrics)
        for how, n in ends.items():
            self.ends[how] += n
        self.error = self.error or episode_error
        if self.logs:
            log.warning("step trained on nothing: every episode failed", step=step,
                        failed=ends["failed"], timeout=ends["timeout"],
                        in_a_row=len(self.streak), max_failed_steps=self.max_failed,
                        error=episode_error or None)
        if len(self.streak) >= self.max_failed and self.failure is None:
            self.failure = NothingTrained(self.cause())
        return {"failed_steps": len(self.streak)}

    def cause(self) -> str:
        """What stops the run, in one line: the steps, the counts by kind, the first error."""
        n, first_step, last_step = len(self.streak), self.streak[0] + 1, self.streak[-1] + 1
        steps = f"steps {first_step}-{last_step}" if n > 1 else f"step {first_step}"
        total = sum(self.ends.values())
        first = self.error or "not reported (see the warnings in the run's log)"
        return (f"nothing trained in {n} step{'s' if n > 1 else ''} in a row ({steps}; "
                f"run.max_failed_steps = {self.max_failed}): every episode "
                f"failed ({self.ends['failed']} failed, {self.ends['timeout']} timed out, "
                f"{self.ends['truncated']} truncated, of {total}); the first error: {first}")

    def stop(self) -> NothingTrained:
        """The error to raise once the caller has written its checkpoint (the resume
        command names it)."""
        assert self.failure is not None
        return NothingTrained(f"{self.failure}; {resume_hint(self.run_dir)}")

    def _collapse(self, step: int, m: Mapping[str, Any]) -> None:
        if self.warned:
            return
        kl, length = m.get("kl"), m.get("response_length")
        ends = episode_ends(m)
        episodes = sum(ends.values())
        if episodes:
            at_limit = ends["truncated"] == episodes
            limit = f"every episode ({episodes}) ran out of tokens (truncated)"
        else:
            at_limit = length is not None and length >= self.max_new_tokens > 1
            limit = (f"every response is at the length limit (generation.max_new_tokens = "
                     f"{self.max_new_tokens})")
        # at the limit from the start is the model's way (an SFT policy that never stops),
        # not a collapse: only after a step whose responses ended
        ended_before, self.ended = self.ended, self.ended or not at_limit
        if self.kl_target > 0 and kl is not None and kl > KL_FAR * self.kl_target:
            seen = (f"the KL to the reference is {kl:.3g} nats a sample, over {KL_FAR:g}x "
                    f"algo.kl_target = {self.kl_target:g}")
        elif at_limit and ended_before:
            seen = limit
        else:
            return
        self.warned = True
        if self.logs:
            log.warning("the policy may have collapsed", step=step, seen=seen,
                        hint=f"a learning rate too high for this model is the usual "
                             f"cause: train.lr = {self.lr:g}; try one 10x lower "
                             f"(train.lr={self.lr / 10:g})")
