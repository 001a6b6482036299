"""What a placement strategy is: a preset placement, the checks it adds, and the runner that
executes it. A strategy is a plain value; `registry.py` maps `placement.strategy` to one.

    preset(placement_cfg, recipe, overrides) -> Placement  where each model and process goes
    placement_problems(placement_cfg, placement) -> [str]  what makes the plan itself invalid
    runner_problems(job_cfg, placement) -> [str]           what this build cannot execute
    run(job_cfg, placement, artefacts, run_dir, start_step) -> RunResult
    pricing: Pricing                                       how `plan` and `auto` price it
    scalable, rebalance, partial_rollout, staleness: bool  what it does beyond lock-step

What a strategy knows of the algorithm is its `Recipe` (`recipe.has_critic`). One that runs
its own processes starts them under `job_coordinator`, which applies the job's `runtime.*`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_async.config import JobConfig, PlacementConfig
from rlhf_async.config.presets import Recipe
from rlhf_async.control.coordinator import Coordinator
from rlhf_async.runtime.launcher import Launcher
from rlhf_async.strategies.placement import Placement
from rlhf_async.strategies.pricing import Pricing
from rlhf_async.task.artefacts import Artefacts

Overrides = dict[str, dict[str, object]]  # model -> {override key: value}


@dataclass(frozen=True)
class RunResult:
    """Where the RL phase of a run left its records, and how long it took."""

    metrics_path: Path
    policy_dir: Path
    seconds: float


class JobStopped(Exception):
    """The RL phase stopped on request (a signal or `rlhf-async stop`) after writing its
    checkpoint; the job reports where it stopped and how to continue."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"stopped on request ({reason})")
        self.reason = reason


class RunFailed(RuntimeError):
    """The RL phase cannot go on, for a reason its message says in one line (a node that
    kept dying, a group that would not form, a rank's error): the command line prints it
    without a traceback. A strategy's own such failures subclass it."""


class UserCodeFailed(RunFailed):
    """The user's environment or reward server failed in a way a rerun would repeat; the
    message names it (type, message, file:line) and how to resume once it is fixed."""


class RankFailed(RunFailed):
    """A rank process of a lock-step run raised; the message is its error's last line (the
    whole traceback is in that rank's stderr)."""


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str  # one line for `rlhf-async plan` and the docs
    roles: tuple[str, ...]  # process roles every placement of it has
    preset: Callable[[PlacementConfig, Recipe, Overrides], Placement]
    placement_problems: Callable[[PlacementConfig, Placement], list[str]]
    runner_problems: Callable[[JobConfig, Placement], list[str]]
    run: Callable[[JobConfig, Placement, Artefacts, Path, int], RunResult]
    pricing: Pricing
    short: str = ""  # its name in table headings ('' = the name)
    # modules the fork server imports once before it forks this strategy's processes (its
    # node programs, named by the strategy: runtime/ knows none)
    fork_preload: tuple[str, ...] = ()
    # what it does beyond generating and training in turn; a job asking for one of these
    # under a strategy without it is refused where its placement is planned
    # (`registry.feature_problems`), and `rlhf-async scale` asks `scalable`
    scalable: bool = False  # generator/scorer processes added or retired while it runs
    rebalance: bool = False  # placement.rebalance: devices moved between those processes
    partial_rollout: bool = False  # its generators take new weights mid-generation
    staleness: bool = False  # generation runs up to algo.max_staleness versions ahead

    @property
    def lock_step(self) -> bool:
        """Every process runs every phase in order (one `worker` role): the strategies a
        launcher (torchrun, srun, Ray ranks) can start rank by rank."""
        return self.roles == ("worker",)


def job_coordinator(cfg: JobConfig, run_dir: Path, launcher: Launcher,
                    **kw: Any) -> Coordinator:
    """The coordinator of a strategy's node processes, with the job's `runtime.*`: a node
    silent for time_to_dead is dead and restarted, up to restart_limit times in a row
    (forgiven after stable_after_s); nodes load within ready_timeout_s; a stop gives them
    stop_grace_s (a trainer's step and checkpoint) before they are killed."""
    r = cfg.runtime
    return Coordinator(run_dir, launcher=launcher, time_to_dead=r.time_to_dead,
                       restart_limit=r.restart_limit, ready_timeout=r.ready_timeout_s,
                       stable_after_s=r.stable_after_s, stop_timeout=r.stop_grace_s + 5.0,
                       **kw)
