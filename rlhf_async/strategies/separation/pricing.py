"""How Separation is priced: its step (stages overlapped in a pipeline: `price`) and the
stage sizes `auto` compares (pipeline balance: `layouts`) and `plan --simulate` tries
(`grid`).

Separation runs three stages side by side: the trainer (actor + critic, one data-parallel
rank per device), generators (one shadow actor per device or tensor-parallel group) and
scorers (reward + reference). The preset gives the trainer one device and the generators
the rest, with the scorers sharing the generators' devices; that is right for some jobs
and leaves a stage idle most of the step in others (a long generation on few generator
devices, a large batch on one trainer rank; a trainer idle while generation and scoring
take turns on the other devices, where the scorers are better beside the trainer).
`auto` prices every split of the devices with the cost model (whose stage times come
from the calibration) and keeps the fastest that this build runs, whenever the user
pinned none of the stage sizes.

    split(base, trainers, scorers, gen_tp, score_tp, beside_trainer) -> PlacementConfig | None
    splits(base)                                     -> every split worth pricing
    layouts(base)                                    -> the splits, unless the user pinned one
    grid(base)                                       -> splits x tensor-parallel sizes
    price(placement, costs)                          -> the step, stages overlapped
    gate_cycle(costs)                                -> the staleness gate's bound on it
"""

from __future__ import annotations

import dataclasses
import itertools

from rlhf_async.config import PlacementConfig
from rlhf_async.strategies.placement import INFER, Placement, override_int, parse_overrides
from rlhf_async.strategies.pricing import StepCosts

# the fields that pin Separation's stage sizes or devices: set by the user, they are kept
PINS = ("actor", "critic", "reward", "reference", "generator", "generators", "scorers",
        "replicas")
# every trainer / scorer size up to this many devices, then a sixteenth-of-the-cluster grid
DENSE = 16


def pinned(cfg: PlacementConfig) -> list[str]:
    """The stage-size fields the user set (balancing keeps them all or balances none)."""
    return [k for k in PINS if getattr(cfg, k)]


def split(base: PlacementConfig, trainers: int, scorers: int, gen_tp: int = 1,
          score_tp: int = 1, beside_trainer: bool = False) -> PlacementConfig | None:
    """Separation on base.devices: trainer ranks on the first `trainers` devices, scorers
    on the last `scorers` (0: sharing the generators' devices, or with `beside_trainer`
    the trainer's), generators on the rest, one process per device or tensor-parallel
    group. None when the sizes do not fit."""
    n = base.devices
    gens = n - trainers - scorers
    if trainers < 1 or scorers < 0 or gens < gen_tp or gens % gen_tp \
            or (beside_trainer and scorers):
        return None
    score_devs = trainers if beside_trainer else scorers or gens
    if score_devs < score_tp or score_devs % score_tp:
        return None
    generator = list(range(trainers, trainers + gens))
    reward = list(range(trainers)) if beside_trainer else \
        list(range(trainers + gens, n)) if scorers else []
    tps = {"shadow_actor": gen_tp, "reward": score_tp, "reference": score_tp}
    kept = [e for e in base.tensor_parallel if e.split("=")[0].strip() not in tps]
    return dataclasses.replace(base, strategy="separation", actor=list(range(trainers)),
                               generator=generator, reward=reward, reference=[],
                               generators=gens // gen_tp, scorers=score_devs // score_tp,
                               tensor_parallel=kept + [f"{m}={t}" for m, t in tps.items()
                                                       if t > 1])


def _sizes(n: int) -> list[int]:
    """Stage sizes worth trying on n devices: all up to DENSE, then n/16 steps."""
    return sorted({*range(1, min(n, DENSE) + 1), *(max(1, n * i // 16) for i in range(1, 16))})


def splits(base: PlacementConfig) -> list[PlacementConfig]:
    """Every (trainer, scorer) split of base.devices, with the generators' and scorers'
    tensor-parallel sizes of base (scorers apart, on the generators' devices or on the
    trainer's)."""
    over, _ = parse_overrides(base)
    gen_tp = override_int(over, "shadow_actor", "tensor_parallel", 1)
    score_tp = override_int(over, "reward", "tensor_parallel", 1)
    n = base.devices
    out = []
    for trainers in (t for t in _sizes(n) if t < n):
        for scorers in (0, *(s for s in _sizes(n) if trainers + s < n)):
            pc = split(base, trainers, scorers, gen_tp, score_tp)
            if pc is not None:
                out.append(pc)
        beside = split(base, trainers, 0, gen_tp, score_tp, beside_trainer=True)
        if beside is not None:
            out.append(beside)
    return out


def layouts(base: PlacementConfig) -> list[PlacementConfig]:
    """The splits `auto` compares: all of them, unless the user pinned a stage's size (then
    only the preset, with what they pinned)."""
    return [] if pinned(base) else splits(base)


def grid(base: PlacementConfig) -> list[PlacementConfig]:
    """A coarse grid for `plan --simulate`: a quarter, half or three quarters of the GPUs
    training, an eighth to a half scoring, and every generator and scorer tensor-parallel
    size up to 8."""
    n, out = base.devices, []
    for train_frac, score_frac in itertools.product((0.25, 0.5, 0.75), (0.125, 0.25, 0.5)):
        nt, ns = max(1, int(n * train_frac)), max(1, int(n * score_frac))
        for tp, ts in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
            pc = split(base, nt, ns, tp, ts)
            if pc is not None:
                out.append(pc)
    return out


def gate_cycle(c: StepCosts) -> float:
    """The step the staleness gate allows at best with `max_staleness = k > 0`: step s + k's
    generation waits for the weights trained on step s - 1, so over k + 1 steps one batch's
    generation, scoring, training and broadcast run in turn: (generate + score + train +
    sync) / (k + 1). A pipeline whose sides are balanced (each ~ half the cycle at k = 1)
    runs at this bound, not at its busiest side."""
    return (c.generate + c.score + c.train + c.sync) / (c.max_staleness + 1)


def price(p: Placement, c: StepCosts) -> tuple[float, dict[str, float]]:
    """Generators and scorers on their own devices overlap each other (chunk by chunk);
    they take turns where they share devices; scorers beside the trainer take its time.
    With algo.max_staleness > 0 the inference side overlaps the trainer too (the step is
    the busiest side, or the staleness gate's cycle where that is longer: `gate_cycle`),
    else a step waits for its weights (the sides add up)."""
    phases = c.phases()
    gen, actor = p.model("shadow_actor"), p.model("actor")
    assert gen is not None and actor is not None  # every Separation placement has both
    score_devs = {d for m in p.models if m.runtime == INFER and m.model != "shadow_actor"
                  for d in m.devices}
    beside = bool(score_devs & set(actor.devices))  # their time counts on the trainer's side
    if beside:
        infer = c.generate
    elif set(gen.devices) & score_devs:
        infer = c.generate + c.score
    else:
        infer = c.slowdown * max(c.generate, c.score)
    train_side = c.train * (c.slowdown if len(actor.devices) > 1 else 1.0) + c.sync + \
        (c.score if beside else 0.0)
    step = c.pipeline_s + (infer + train_side if c.max_staleness == 0
                           else c.slowdown * max(infer, train_side, gate_cycle(c)))
    return step, phases
