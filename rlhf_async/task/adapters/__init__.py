"""Environment adapters: outside packages' environments and datasets as the text task's
prompts, episodes and reward, chosen by a prefix: `task.env = "openenv:<module:app or
URL>"` (OpenEnv servers), `task.env = "verifiers:<environment>"` (verifiers environments),
`task.prompts = "reasoning_gym:<dataset>"` (reasoning-gym datasets).

`ADAPTERS` maps each prefix to its class ("module:Class", imported only when a job names
it, so a run without one never imports its package); the class keeps the contract in
`interface.py`. A new adapter is one module and one line here. This module is the only
place that reads a prefix: the config layer cannot import this package, so it checks
syntax only, and `adapter_problems` (from `prepare_run`, before anything starts) checks
the rest.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from pathlib import Path

from rlhf_async.config import ConfigError, JobConfig, TaskConfig
from rlhf_async.config.presets import distills
from rlhf_async.config.task import adapter_syntax
from rlhf_async.task.adapters.interface import KEYS, EnvironmentAdapter, Rows, Scorer

__all__ = ["ADAPTERS", "KEYS", "EnvironmentAdapter", "Rows", "Scorer", "adapter_lines",
           "adapter_problems", "adopt_adapter_lines", "check_reachable", "chosen", "preload"]

# prefix -> "module:Class" (what follows '<prefix>:' is the class's argument)
ADAPTERS: dict[str, str] = {
    "openenv": "rlhf_async.task.adapters.openenv:OpenEnvAdapter",
    "verifiers": "rlhf_async.task.adapters.verifiers:VerifiersAdapter",
    "reasoning_gym": "rlhf_async.task.adapters.reasoning_gym:ReasoningGymAdapter",
}


@functools.cache
def _load(path: str) -> type[EnvironmentAdapter]:
    module, _, name = path.partition(":")
    cls: type[EnvironmentAdapter] = getattr(importlib.import_module(module), name)
    return cls


def _named(value: str) -> tuple[str, type[EnvironmentAdapter], str] | None:
    """(prefix, class, argument) when `value` names a registered adapter."""
    prefix, sep, argument = value.partition(":")
    if not sep or prefix not in ADAPTERS:
        return None
    return prefix, _load(ADAPTERS[prefix]), argument


def adapter_lines(t: TaskConfig) -> dict[str, str]:
    """The `ADAPTERS` lines `t` names, as plain data for the job's processes: a line
    registered at run time (a test, a notebook) is in this process's registry only, and the
    nodes and ranks take it from here (`adopt_adapter_lines`)."""
    prefixes = (getattr(t, key).partition(":") for key in KEYS)
    return {prefix: ADAPTERS[prefix] for prefix, sep, _ in prefixes
            if sep and prefix in ADAPTERS}


def adopt_adapter_lines(lines: Mapping[str, str]) -> None:
    """In a job's process: the lines of `adapter_lines` its registry lacks, added (a line
    of the same prefix here is kept: the built-in ones are the same everywhere)."""
    for prefix, path in lines.items():
        ADAPTERS.setdefault(prefix, path)


def chosen(t: TaskConfig) -> list[EnvironmentAdapter]:
    """The adapters `task.env` and `task.prompts` name (none, one or two), made for `t`;
    their own problems are one ConfigError here, so whatever reads an adapter's rows (the
    task, the planner's prompt length) never meets a bad argument."""
    out, problems = [], []
    for key in KEYS:
        found = _named(getattr(t, key))
        if found is None:
            continue
        prefix, cls, argument = found
        if cls.key != key:
            problems.append(_misplaced(key, getattr(t, key), prefix, cls))
            continue
        adapter = cls(argument, t)
        problems += adapter.problems()
        out.append(adapter)
    if problems:
        raise ConfigError(problems)
    return out


def _misplaced(key: str, value: str, prefix: str, cls: type[EnvironmentAdapter]) -> str:
    return (f"task.{key}: {value!r}: '{prefix}:' names an adapter of task.{cls.key}, not of "
            f"task.{key}")


def adapter_problems(cfg: JobConfig) -> list[str]:
    """Every problem of the adapters `cfg` names (their own checks, and what they need of
    the rest of `[task]`), each naming its key; [] for a task that is not the text task."""
    t, out = cfg.task, []
    if t.name != "text":
        return []
    for key in KEYS:
        value = getattr(t, key)
        found = _named(value)
        if found is None:
            if key == "prompts" and adapter_syntax(value) and not Path(value).exists():
                out.append(f"task.prompts: {value!r} is neither a file nor a directory nor "
                           f"an adapter's '<prefix>:<argument>' (prefixes: "
                           f"{', '.join(sorted(ADAPTERS))})")
            continue
        prefix, cls, argument = found
        if cls.key != key:
            out.append(_misplaced(key, value, prefix, cls))
            continue
        out += cls(argument, t).problems()
        if key == "env" and cls.gives_prompts and t.prompts:
            out.append(f"task.prompts: {t.prompts!r} beside task.env = {t.env!r}: the "
                       f"'{prefix}:' adapter's rows are the prompts; remove task.prompts")
        if key == "prompts" and not cls.gives_reward and not (
                t.reward or cfg.reward_model.path or t.env or t.agent or distills(cfg.algo)):
            out.append(f"task.reward: task.prompts = {value!r} gives prompts but no reward; "
                       "set task.reward (or a reward_model.path, a task.env or a task.agent)")
    # (a task.env that is no adapter's name the config layer has checked)
    if not t.prompts and adapter_syntax(t.env) and \
            not any(c.gives_prompts for c in _classes(t)):
        out.append(f"task.prompts: task.env = {t.env!r} gives no prompts; set task.prompts "
                   "(a data file, a directory or a cached dataset id)")
    return out


def _classes(t: TaskConfig) -> list[type[EnvironmentAdapter]]:
    return [found[1] for key in KEYS if (found := _named(getattr(t, key))) is not None]


def check_reachable(t: TaskConfig) -> None:
    """What the chosen adapters reach outside this process, once before anything starts
    (not again in every node or rank, where it would cost each seconds)."""
    for adapter in chosen(t):
        adapter.check_reachable()


def preload(t: TaskConfig) -> tuple[str, ...]:
    """Modules the chosen adapters import slowly as the task loads: the fork server imports
    them once (before a node's first heartbeats would stall on them)."""
    return tuple(m for cls in _classes(t) for m in cls.preload)
