"""Staleness policy: how far generation may run ahead of training, enforced in one place.

Why: in the Separation strategy the generators keep producing rollouts while the trainer
is still optimising on older ones. Letting them run ahead buys throughput, but a rollout
generated with weights that are many versions old is off-policy and hurts PPO. This
module is the single owner of that rule, so the dispatcher (which decides when prompts may
be handed out) and the trainer (which decides whether a finished rollout may be trained
on) can never disagree.

Definitions (steps and versions count from 0):

* A step is one training step on one batch (however many optimizer updates its epochs and
  minibatches take). The trainer publishes weights every ``publish_every = N`` steps; the
  version ``v`` is the number of publications so far, the initial weights being version 0.
* A synchronous run generates batch ``s`` with version ``floor(s / N)``: version ``v``
  appears only after ``v * N`` steps, i.e. after batch ``v * N - 1`` trained.
* ``max_staleness = k``: a batch may be generated with any version in
  ``[floor(s / N) - k, floor(s / N)]``. ``k = 0`` is synchronous on-policy RLHF.

With partial rollouts (``generation.partial_rollout``) a generator takes new weights between
two decode steps of a chunk, so one response's tokens may come from several versions; the
rollout's version is its OLDEST token's, and that is what is admitted here: ``max_staleness``
bounds the oldest token (newer tokens are within it by construction). At ``k = 0`` no
version can arrive mid-chunk (the next one needs this very batch trained), so nothing changes.

A rollout that claims a version newer than ``floor(s / N)`` cannot come from a correct
pipeline (that version does not exist yet when batch ``s`` is trained); it is rejected and
counted separately instead of crashing the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

# A lazy proxy: picks up configure_logging() even when called after this import.
log = structlog.get_logger(component="staleness")

_STATE_FORMAT = 1


class StalenessPolicy:
    """Admission and dispatch rules for asynchronous generation, plus their counters."""

    def __init__(self, max_staleness: int, publish_every: int = 1) -> None:
        problems = []
        if (
            not isinstance(max_staleness, int)
            or isinstance(max_staleness, bool)
            or max_staleness < 0
        ):
            problems.append(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        if (
            not isinstance(publish_every, int)
            or isinstance(publish_every, bool)
            or publish_every < 1
        ):
            problems.append(f"publish_every must be an integer >= 1, got {publish_every!r}")
        if problems:
            raise ValueError("; ".join(problems))
        self.max_staleness = max_staleness
        self.publish_every = publish_every
        self.admitted = 0
        self.dropped = 0
        self.rejected_future = 0
        self.histogram: dict[int, int] = {}
        self._since = self._counts()  # the counts at the last `metrics()`: a step's start

    def _counts(self) -> tuple[int, int, int, dict[int, int]]:
        return self.admitted, self.dropped, self.rejected_future, dict(self.histogram)

    def sync_version(self, step: int) -> int:
        """The version a synchronous run would use to generate batch `step`."""
        _check_nonneg("step", step)
        return step // self.publish_every

    def required_version(self, step: int) -> int:
        """The oldest weight version allowed to generate batch `step`."""
        return max(0, self.sync_version(step) - self.max_staleness)

    def can_dispatch(self, step: int, published_version: int) -> bool:
        """Whether prompts of batch `step` may go to generators holding `published_version`."""
        _check_nonneg("published_version", published_version)
        return published_version >= self.required_version(step)

    def dispatch_limit(self, published_version: int) -> int:
        """First step that may NOT be dispatched yet: steps below it pass `can_dispatch`."""
        _check_nonneg("published_version", published_version)
        return (published_version + self.max_staleness + 1) * self.publish_every

    def admit(self, step: int, rollout_version: int) -> bool:
        """Whether the trainer may train batch `step` on a rollout generated with that version.

        Counts the outcome; admitted rollouts add to the staleness histogram.
        """
        _check_nonneg("rollout_version", rollout_version)
        staleness = self.sync_version(step) - rollout_version
        if staleness < 0:
            self.rejected_future += 1
            log.warning(
                "rollout_from_future",
                step=step,
                rollout_version=rollout_version,
                newest_possible=self.sync_version(step),
            )
            return False
        if staleness > self.max_staleness:
            self.dropped += 1
            return False
        self.admitted += 1
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1
        return True

    def metrics(self) -> dict[str, float]:
        """Flat numbers for the metrics sink (not the log), once per training step: what
        was counted since the previous call (`staleness/admitted`, `/dropped`,
        `/rejected_future`, `/mean`, `/hist/<s>`) and since the run began (`*_total`)."""
        admitted, dropped, future, hist = self._since
        step_hist = {s: n - hist.get(s, 0) for s, n in self.histogram.items()
                     if n - hist.get(s, 0) > 0}
        out = {"staleness/admitted": float(self.admitted - admitted),
               "staleness/dropped": float(self.dropped - dropped),
               "staleness/rejected_future": float(self.rejected_future - future),
               "staleness/admitted_total": float(self.admitted),
               "staleness/dropped_total": float(self.dropped),
               "staleness/rejected_future_total": float(self.rejected_future)}
        for suffix, h in (("", step_hist), ("_total", self.histogram)):
            if sum(h.values()):
                out[f"staleness/mean{suffix}"] = (sum(s * n for s, n in h.items())
                                                  / sum(h.values()))
        for s, n in sorted(step_hist.items()):
            out[f"staleness/hist/{s}"] = float(n)
        self._since = self._counts()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON- and msgpack-safe) for checkpoints."""
        return {
            "format": _STATE_FORMAT,
            "max_staleness": self.max_staleness,
            "publish_every": self.publish_every,
            "admitted": self.admitted,
            "dropped": self.dropped,
            "rejected_future": self.rejected_future,
            "histogram": [[s, n] for s, n in sorted(self.histogram.items())],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters. The policy's own settings come from the config, not the file:
        a resumed run may change `max_staleness`; the counters carry over either way."""
        if not isinstance(state, Mapping):
            # ValueError like every other bad-state case, so the checkpoint loader catches one type
            raise ValueError(
                f"staleness state: expected a mapping, got {type(state).__name__}"
            )
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"staleness state: format {state.get('format')!r} not understood "
                f"(accepted: {_STATE_FORMAT})"
            )
        try:
            counters = {k: int(state[k]) for k in ("admitted", "dropped", "rejected_future")}
            histogram = {int(s): int(n) for s, n in state["histogram"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                "staleness state: needs integer 'admitted', 'dropped', 'rejected_future' and "
                f"'histogram' as [[staleness, count], ...]: {exc}"
            ) from None
        if any(v < 0 for v in counters.values()) or any(
            s < 0 or n < 0 for s, n in histogram.items()
        ):
            raise ValueError("staleness state: counters and histogram entries must be >= 0")
        self.admitted = counters["admitted"]
        self.dropped = counters["dropped"]
        self.rejected_future = counters["rejected_future"]
        self.histogram = histogram
        self._since = self._counts()


def _check_nonneg(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
