"""A running job's change of shape, as data: the `Scale` request (`rlhf-async scale RUN_DIR
generators=N scorers=M`, or the daemon's `scale` op) and the `Reshape` it means for the
processes running now: which to start, on which free devices, and which to retire.

    scale = parse_scale(["generators=2"])                 # ReshapeError on bad input
    plan = plan_reshape(processes, num_devices, scale)   # ReshapeError if it cannot fit

Nothing here starts or stops a process; the strategy that runs the job applies a `Reshape`
(Separation: strategies/separation/scaling.py). Processes are plain (node_id, role,
devices) so the same plan is tested without a placement or a process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlhf_async.runtime.messages import Command, Msg, Refused

# the keys a scale request takes -> the role whose process count they set, and how a new
# process of that role is named (the same ids the strategy's preset gives: gen0, gen1, ...)
KEYS = {"generators": "generator", "scorers": "scorer"}
PREFIX = {"generator": "gen", "scorer": "scorer"}


class ReshapeError(Refused):
    """A scale request that cannot be done; the message says what is wrong and what is
    accepted. The job goes on with its shape unchanged."""


class Scaled(Msg, frozen=True):
    """The shape after a scale: processes started and retired, and each role's count."""

    added: list[str]
    removed: list[str]
    counts: dict[str, int]


class Scale(Command[Scaled], frozen=True, tag="scale"):
    """Set the number of generator and/or scorer processes (None: leave as it is)."""

    generators: int | None = None
    scorers: int | None = None

    def targets(self) -> dict[str, int]:
        """Role -> the process count asked for; ReshapeError for a count below 1."""
        asked = {"generators": self.generators, "scorers": self.scorers}
        bad = [f"{k}={v}" for k, v in asked.items() if v is not None and v < 1]
        if bad:
            raise ReshapeError(f"{', '.join(bad)}: a count must be at least 1 (a job keeps "
                               "one generator and one scorer)")
        if all(v is None for v in asked.values()):
            raise ReshapeError("nothing to scale: give generators=N and/or scorers=M")
        return {KEYS[k]: v for k, v in asked.items() if v is not None}


def parse_scale(args: Sequence[str]) -> Scale:
    """`["generators=2", "scorers=1"]` -> Scale; every problem in one ReshapeError."""
    problems, counts = [], dict[str, int]()
    for arg in args:
        key, eq, value = arg.partition("=")
        key = key.strip()
        if not eq:
            problems.append(f"{arg!r}: expected KEY=N")
        elif key not in KEYS:
            problems.append(f"unknown key {key!r}; accepted: {', '.join(KEYS)}")
        elif not re.fullmatch(r"\s*-?\d+\s*", value):
            problems.append(f"{key}={value!r}: expected a whole number")
        elif key in counts:
            problems.append(f"{key} given twice")
        else:
            counts[key] = int(value)
    if problems:
        raise ReshapeError("; ".join(problems))
    scale = Scale(**counts)
    scale.targets()  # counts below 1, or none given
    return scale


Process = tuple[str, tuple[int, ...]]  # role, devices


@dataclass(frozen=True)
class Reshape:
    """What a scale changes: processes to start (node id -> (role, devices)) and node ids
    to retire; `counts` is each role's process count afterwards."""

    add: dict[str, Process]
    remove: tuple[str, ...]
    counts: dict[str, int]

    @property
    def empty(self) -> bool:
        return not self.add and not self.remove


def _index(node_id: str, role: str) -> int:
    tail = node_id.removeprefix(PREFIX[role])
    return int(tail) if tail.isdigit() else -1


def plan_reshape(processes: Mapping[str, Process], num_devices: int,
                 targets: Mapping[str, int], width: Mapping[str, int] | None = None,
                 device_word: str = "device") -> Reshape:
    """The processes to start and retire so each role of `targets` has that many.

    Retired first: the newest processes of a role (highest index). Started: with the
    lowest free indexes, each on `width[role]` devices (a tensor-parallel generator's)
    that no process uses after the retirements; too few of them is a ReshapeError naming
    what is free and what is needed."""
    width = width or {}
    remove: list[str] = []
    counts = {}
    for role, want in targets.items():
        mine = [n for _, n in sorted((_index(n, role), n)
                                     for n, (r, _) in processes.items() if r == role)]
        remove += mine[want:][::-1]
        counts[role] = want
    used = {d for n, (_, devs) in processes.items() if n not in remove for d in devs}
    free = [d for d in range(num_devices) if d not in used]
    add: dict[str, Process] = {}
    taken = {n for n in processes if n not in remove}
    short = []
    for role, want in targets.items():
        have = sum(1 for n, (r, _) in processes.items() if r == role)
        for _ in range(max(0, want - have)):
            k = width.get(role, 1)
            if len(free) < k:
                short.append((role, want, want - have, k))
                break
            i = next(i for i in range(len(taken) + 1) if f"{PREFIX[role]}{i}" not in taken)
            taken.add(f"{PREFIX[role]}{i}")
            add[f"{PREFIX[role]}{i}"], free = (role, tuple(free[:k])), free[k:]
    if short:
        need = sum(n * k for _, _, n, k in short)
        asks = ", ".join(f"{role}s={want} needs {n} more process(es) of {k} {device_word}(s)"
                         for role, want, n, k in short)
        raise ReshapeError(
            f"not enough free {device_word}s: {asks} ({need} in all), but of placement.devices = "
            f"{num_devices} only {sorted(d for d in range(num_devices) if d not in used)} "
            f"are free (in use: {sorted(used)}); retire other processes first, or resume "
            f"the run with a larger placement.devices")
    return Reshape(add, tuple(remove), counts)
