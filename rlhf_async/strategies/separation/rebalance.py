"""Online rebalancing (`placement.rebalance = true`): a running Separation job moves a device
between its generator and scorer roles when the stage times it measures say a step would
be faster.

Every `placement.rebalance_every` steps the Driver's step records (`util/<node>`: each
node's busy share of the step, `time_step`) give each stage's work per step in busy
seconds, summed over its processes. The cost model's Separation price (`pricing.price`,
what `auto` uses before the run) is then recalibrated with them: a stage of n processes
takes its work / n, the trainer its own. The current shape and its two neighbours (one
device from the scorers to the generators, or back) are priced; a neighbour whose
predicted step is shorter by more than `placement.rebalance_gain` is applied through the
scale path (scaling.py). Hysteresis: after a move the next decision waits a whole window
of steps measured in the new shape, and the gain must pass the threshold, so two shapes
within it never alternate. Each decision is a line on the console saying why, its record
in the run's log (`rebalance_decision`, RUN_DIR/logs/job.log) and fields of that step's
metrics record (`rebalance/*`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_async.control.reshape import ReshapeError, Scale, plan_reshape
from rlhf_async.log import get_logger
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.pricing import StepCosts
from rlhf_async.strategies.separation.pricing import price
from rlhf_async.strategies.separation.scaling import Scaler, reshaped

log = get_logger(component="rebalance")
ROLES = ("generator", "scorer")


@dataclass(frozen=True)
class Work:
    """Busy seconds per step of each stage, summed over its processes."""

    generate: float
    score: float
    train: float

    @classmethod
    def of(cls, records: list[dict[str, Any]], roles: dict[str, str]) -> Work:
        """The mean over `records` (step records: `util/<node>` x `time_step`)."""
        sums = dict.fromkeys(("generator", "scorer", "trainer"), 0.0)
        for r in records:
            for key, share in r.items():
                role = roles.get(key.removeprefix("util/")) if key.startswith("util/") else None
                if role in sums:
                    sums[role] += share * r["time_step"]
        n = max(1, len(records))
        return cls(sums["generator"] / n, sums["scorer"] / n, sums["trainer"] / n)


def predicted_step(p: Placement, work: Work, max_staleness: int) -> float:
    """The step the cost model's Separation price gives `p` with stage times from `work`."""
    gens, scorers = len(p.by_role("generator")), len(p.by_role("scorer"))
    costs = StepCosts(generate=work.generate / max(1, gens), score=work.score / max(1, scorers),
                      train=work.train, sync=0.0, exchange=0.0, slowdown=1.0, pipeline_s=0.0,
                      max_staleness=max_staleness)
    return price(p, costs)[0]


def neighbours(p: Placement) -> list[tuple[Scale, Placement]]:
    """The shapes one device away: a scorer's device to a new generator, or back."""
    counts = {r: len(p.by_role(r)) for r in ROLES}
    procs = {q.node_id: (q.role, q.devices) for q in p.processes}
    out = []
    for give, take in (("scorer", "generator"), ("generator", "scorer")):
        if counts[give] < 2:
            continue
        want = {give: counts[give] - 1, take: counts[take] + 1}
        try:
            plan = plan_reshape(procs, p.num_devices, want)
        except ReshapeError:  # no device frees up (processes sharing one)
            continue
        out.append((Scale(generators=want["generator"], scorers=want["scorer"]),
                    reshaped(p, plan)))
    return out


class Rebalancer:
    """`observe(record)` on every step record (the Driver's `records.on_record`); moves through
    `scaler` in the background (`spawn`)."""

    def __init__(self, scaler: Scaler, every: int, gain: float, max_staleness: int,
                 spawn: Callable[[Any], Any]) -> None:
        self.scaler, self.every, self.gain = scaler, every, gain
        self.max_staleness, self.spawn = max_staleness, spawn
        self.window: list[dict[str, Any]] = []
        self.moving: asyncio.Future[Any] | None = None

    def observe(self, record: dict[str, Any]) -> None:
        if (self.moving is not None and not self.moving.done()) or self.scaler.driver.joining:
            return  # steps of a shape changing under them (new nodes still loading)
            # measure neither shape
        self.window.append(record)
        if len(self.window) < self.every:
            return
        decision = self.decide(self.window)
        self.window = []
        record.update({f"rebalance/{k}": v for k, v in decision.items() if k != "scale"})
        if decision.get("scale") is not None:
            self.moving = asyncio.ensure_future(self._move(decision["scale"]))
            self.spawn(self.moving)

    def decide(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The decision for a window of step records, with why (a line on the console)."""
        p = self.scaler.placement
        roles = {q.node_id: q.role for q in p.processes}
        work = Work.of(records, roles)
        now = predicted_step(p, work, self.max_staleness)
        priced = [(predicted_step(shape, work, self.max_staleness), scale)
                  for scale, shape in neighbours(p)]
        best: tuple[float, Scale | None] = min([(now, None), *priced],
                                               key=lambda x: x[0])
        gain = (now - best[0]) / now if now > 0 else 0.0
        move = best[1] if gain > self.gain else None
        counts = {r: len(p.by_role(r)) for r in ROLES}
        decision: dict[str, Any] = {
            "predicted_step_s": now, "best_step_s": best[0], "gain": gain,
            "generators": counts["generator"], "scorers": counts["scorer"],
            "moved": int(move is not None), "scale": move,
            "generate_s": work.generate, "score_s": work.score, "train_s": work.train}
        why = ("predicted gain passes placement.rebalance_gain" if move is not None else
               "no shape one device away is faster by more than placement.rebalance_gain")
        log.info("rebalance_decision", why=why, gain=round(gain, 3),
                 predicted_step_s=round(now, 4), best_step_s=round(best[0], 4),
                 shape=counts, to=None if move is None else
                 {"generators": move.generators, "scorers": move.scorers},
                 work={"generate": round(work.generate, 4), "score": round(work.score, 4),
                       "train": round(work.train, 4)},
                 console=self._sentence(records, counts, now, priced, gain, move))
        return decision

    def _sentence(self, records: list[dict[str, Any]], counts: dict[str, int], now: float,
                  priced: list[tuple[float, Scale]], gain: float, move: Scale | None) -> str:
        """The decision for people: the shape, kept or moved to, and the numbers why."""
        step = records[-1].get("step") if records else None
        shape = _shape(counts["generator"], counts["scorer"])
        head = f"after {step + 1} steps: " if isinstance(step, int) else ""  # steps from 0
        threshold = f"placement.rebalance_gain {self.gain:.0%}"
        if move is not None:
            gens = counts["generator"] if move.generators is None else move.generators
            scorers = counts["scorer"] if move.scorers is None else move.scorers
            give, take = (("scorers", "generators") if gens > counts["generator"]
                          else ("generators", "scorers"))
            return (f"{head}moving a device from the {give} to the {take} ({shape} -> "
                    f"{_shape(gens, scorers)}): predicted step {now:.3g} s "
                    f"-> {now * (1 - gain):.3g} s, gain {gain:.0%} > {threshold}")
        if not priced:
            return (f"{head}keeping {shape}: no shape is one device away (a role gives a "
                    "device only from a second process on a device of its own)")
        nearest = min(step_s for step_s, _ in priced)
        return (f"{head}keeping {shape}: the best shape one device away predicts "
                f"{nearest:.3g} s against {now:.3g} s now, gain {max(gain, 0.0):.0%} <= "
                f"{threshold}")

    async def _move(self, scale: Scale) -> None:
        try:
            scaled = await self.scaler.scale(scale)
            log.info("rebalanced", added=scaled.added, removed=scaled.removed,
                     counts=scaled.counts, console=f"moved: {', '.join(scaled.added)} "
                     f"started, {', '.join(scaled.removed)} retired")
        except ReshapeError as e:  # e.g. the job is stopping: the shape stays
            log.warning("rebalance_refused", reason=str(e))


def _shape(generators: int, scorers: int) -> str:
    return (f"{generators} generator{'s' * (generators != 1)} + "
            f"{scorers} scorer{'s' * (scorers != 1)}")
