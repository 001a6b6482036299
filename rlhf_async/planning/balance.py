"""Pipeline balance: Separation's stage sizes chosen from predicted stage times.

Separation runs three stages side by side: the trainer (actor + critic, one data-parallel
rank per device), generators (one shadow actor per device or tensor-parallel group) and
scorers (reward + reference). The preset gives the trainer one device and the generators
the rest, with the scorers sharing the generators' devices; that is right for some jobs
and leaves a stage idle most of the step in others (a long generation on few generator
devices, a large batch on one trainer rank; a trainer idle while generation and scoring
take turns on the other devices, where the scorers are better beside the trainer).
`balanced` prices every split of the devices with the cost model (whose stage times come
from the calibration) and returns the fastest that this build runs. `auto` uses it
whenever the user pinned none of the stage sizes; `plan --simulate` prices the same
splits.

    split(base, trainers, scorers, gen_tp, score_tp, beside_trainer) -> PlacementConfig | None
    splits(base)                                     -> every split worth pricing
    balanced(cfg, price)                             -> the fastest runnable one
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.strategies.placement import (
    Placement,
    PlacementError,
    override_int,
    parse_overrides,
)
from rlhf_async.strategies.registry import runnable_placement

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


def balanced(cfg: JobConfig, price: Callable[[Placement], tuple[float, bool]]
             ) -> tuple[JobConfig, Placement] | None:
    """The job with the split of Separation whose predicted step (`price`: seconds and
    whether it fits in memory) is the shortest among those `run` accepts; None when no
    split runs. Ties keep the fewest trainer ranks (less gradient traffic)."""
    best: tuple[float, JobConfig, Placement] | None = None
    for pc in splits(cfg.placement):
        job = dataclasses.replace(cfg, placement=pc)
        try:
            p = runnable_placement(job)
        except PlacementError:
            continue
        step, fits = price(p)
        if fits and (best is None or step < best[0] * (1 - 1e-9)):
            best = (step, job, p)
    return None if best is None else (best[1], best[2])
