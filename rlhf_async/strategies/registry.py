"""The strategies by name, and planning a placement through them.

Adding a strategy is one module that defines a `Strategy` value and one line below.
`placement.strategy = "auto"` is not a strategy: the planner (`planning.planner`) resolves
it to one of these before anything runs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf_async.config import AlgoConfig, JobConfig, PlacementConfig
from rlhf_async.config.presets import resolve
from rlhf_async.control import scale as control_scale
from rlhf_async.control.reshape import Scale, Scaled
from rlhf_async.engines import (
    ENGINES,
    MissingExtraError,
    engine_capabilities,
    engine_class,
    generation_engine,
)
from rlhf_async.strategies import flattening, interleaving
from rlhf_async.strategies.base import Strategy
from rlhf_async.strategies.placement import (
    Placement,
    PlacementError,
    config_problems,
    parse_overrides,
    validate,
    with_engines,
)
from rlhf_async.strategies.separation import strategy as separation_strategy

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    flattening.STRATEGY,
    interleaving.STRATEGY,
    separation_strategy.STRATEGY,
)}
AUTO = "auto"


@dataclass(frozen=True)
class Feature:
    """What a job may ask that only some strategies do: its config key, whether `cfg` asks
    it, which `Strategy` field says a strategy does it, what it does, how to turn it off."""

    key: str
    asked: Callable[[JobConfig], bool]
    honoured: Callable[[Strategy], bool]
    does: Callable[[JobConfig], str]
    off: str


FEATURES = (
    Feature("placement.rebalance", lambda c: c.placement.rebalance, lambda s: s.rebalance,
            lambda c: "moves devices between a job's generator and scorer processes",
            "placement.rebalance = false"),
    Feature("generation.partial_rollout", lambda c: c.generation.partial_rollout,
            lambda s: s.partial_rollout,
            lambda c: "has generators take new weights during a generation",
            "generation.partial_rollout = false"),
    Feature("algo.max_staleness", lambda c: c.algo.max_staleness > 0, lambda s: s.staleness,
            lambda c: f"lets generation run up to {c.algo.max_staleness} weight version(s) "
                      "ahead of training", "algo.max_staleness = 0"),
)


def get(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise PlacementError([f"placement.strategy: {name!r} is not a strategy; accepted: "
                              f"{', '.join([*STRATEGIES, AUTO])}"])
    return STRATEGIES[name]


def build_placement(cfg: PlacementConfig, algo: str) -> tuple[Placement | None, list[str]]:
    """The placement for algorithm `algo` (`algo.name`: the preset's recipe says whether
    it trains a critic), None when the config cannot be placed at all, and every problem of
    the plan itself (not of what this build's runners execute: see `runner_problems`)."""
    over, problems = parse_overrides(cfg)
    problems += config_problems(cfg)
    if cfg.strategy not in STRATEGIES:
        accepted = ", ".join(STRATEGIES)
        how = " (auto: the planner resolves it first)" if cfg.strategy == AUTO else ""
        problems.append(f"placement.strategy: {cfg.strategy!r} cannot be placed directly"
                        f"{how}; accepted: {accepted}")
        return None, problems
    strategy = STRATEGIES[cfg.strategy]
    placement = strategy.preset(cfg, resolve(AlgoConfig(name=algo)), over)
    problems += validate(placement, strategy.roles)
    problems += strategy.placement_problems(cfg, placement)
    if cfg.teacher and "scorer" not in strategy.roles:
        problems.append(f"placement.teacher: {strategy.name} holds the teacher with the "
                        "reference (every rank, or the reference's devices); devices of its "
                        "own are for scorer processes: use placement.strategy = 'separation' "
                        "or leave placement.teacher empty")
    return placement, problems


def plan_placement(cfg: PlacementConfig, algo: str) -> Placement:
    """The valid placement for a config; PlacementError lists every problem."""
    placement, problems = build_placement(cfg, algo)
    if problems or placement is None:
        raise PlacementError(problems)
    return placement


def runner_problems(cfg: JobConfig, placement: Placement) -> list[str]:
    """What this build's runner for the placement's strategy cannot execute, all of it:
    a generation engine that needs generator processes, then the strategy's own limits
    (which see the placement with the job's engines filled in)."""
    engines = with_engines(placement, cfg.train.backend, generation_engine(cfg))
    # (the lock-step strategies run a generation engine other than the default beside
    # each rank's trainer: strategies/colocated.py)
    problems = engine_problems(cfg)
    own = STRATEGIES[placement.strategy].runner_problems(cfg, engines)
    return problems + [p for p in own if p not in problems]


def runnable_placement(cfg: JobConfig) -> Placement:
    """The placement of a config whose strategy is resolved, with every problem of the plan
    and of running it in one PlacementError."""
    placement, problems = build_placement(cfg.placement, cfg.algo.name)
    if placement is not None:
        problems += [p for p in runner_problems(cfg, placement) if p not in problems]
    if problems or placement is None:
        raise PlacementError(problems)
    return placement


def feature_problems(cfg: JobConfig, auto: bool = False) -> list[str]:
    """What `cfg` asks that its (resolved) strategy does not do, asked of the strategy's
    fields (never of its name); `auto`: the planner chose that strategy."""
    if cfg.placement.strategy not in STRATEGIES:
        return []
    strategy, out = STRATEGIES[cfg.placement.strategy], []
    how = "generates and trains in turn" if strategy.lock_step else "does not"
    for f in FEATURES:
        if not f.asked(cfg) or f.honoured(strategy):
            continue
        able = " or ".join(n for n, s in STRATEGIES.items() if f.honoured(s))
        who = able or "no strategy here"
        if auto:
            fix = f"placement.strategy = {able} (or {f.off})" if able else f.off
            out.append(f"{f.key}: placement.strategy = auto chose {strategy.name!r}, which "
                       f"{how}; it {f.does(cfg)} under {who} only; set {fix}")
        else:
            fix = f"placement.strategy = {able}, or auto resolving to it; or " if able else ""
            out.append(f"{f.key}: {f.does(cfg)}, which {'only ' if able else ''}{who} does; "
                       f"placement.strategy = {strategy.name!r} {how} (accepted: {fix}"
                       f"{f.off})")
    return out


def scale_refusal(strategy: str) -> str | None:
    """Why `rlhf-async scale` cannot change a running job of `strategy`; None if it can."""
    if strategy in STRATEGIES and STRATEGIES[strategy].scalable:
        return None
    able = " or ".join(n for n, s in STRATEGIES.items() if s.scalable) or "no strategy here"
    if strategy in STRATEGIES and not STRATEGIES[strategy].lock_step:
        why = f"{strategy} keeps its processes while it runs"
    else:
        *most, last = [n for n, s in STRATEGIES.items() if s.lock_step] or [strategy]
        why = f"{', '.join(most)} and {last} hold" if most else f"{last} holds"
        why += " every model in one process per device"
    return f"scale changes a running {able} job only ({why})"


async def request_scale(run_dir: Path, scale: Scale, timeout: float) -> Scaled:
    """`control.scale.request_scale`, refused for a job whose strategy does not scale."""
    return await control_scale.request_scale(run_dir, scale, timeout, scale_refusal)


def engine_problems(cfg: JobConfig) -> list[str]:
    """What the configured generation engine cannot do, asked of its capabilities (never
    of its name): match stop strings, where the job has them."""
    g, backend = cfg.generation, generation_engine(cfg)
    if g.stop_strings and not engine_capabilities(backend).stop_strings:
        able = [n for n in ENGINES if engine_capabilities(n).stop_strings]
        return [f"generation.stop_strings: generation.backend = {backend!r} cannot match "
                f"stop strings (its engine runs without a tokenizer); use "
                f"generation.stop_token_ids, or generation.backend = {' | '.join(able)}"]
    return []


def missing_engine_problems(cfg: JobConfig) -> list[str]:
    """Before a run here: the generation engine's optional package is installed."""
    try:
        engine_class(generation_engine(cfg))
    except MissingExtraError as e:
        here = [n for n, x in ENGINES.items()
                if (x.extra is None or importlib.util.find_spec(x.extra) is not None)
                and cfg.placement.device in engine_capabilities(n).devices]
        return [f"generation.backend: {e}; accepted here: {', '.join(here)}"]
    return []
