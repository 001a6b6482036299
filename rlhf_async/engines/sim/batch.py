"""A simulated generator's continuous batch: rows prefill and decode in lock-step steps,
each priced by the cost model (`SimSpec.prefill_s`, `decode_s`), and simulated time moves
only when the caller says how much has passed (`advance`). Nothing here sleeps or reads a
clock: the engine (`engine.py`) sleeps until `until_next_end`, then advances by what really
passed; tests advance by hand.

As a real engine's scheduler: at most `SimSpec.max_rows` rows hold KV cache at once (the
rest wait), rows that join are prefilled together before the next decode step, and each
decode step adds one token to every running row, stamped with the weight version served.
A step in progress when time stops is kept as credit: its time is not paid twice.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from rlhf_async.engines.sim.spec import SimSpec


@dataclass
class Row:
    """One request in the batch: `total` simulated tokens to generate, `done` so far."""

    rid: str
    total: int
    done: int = 0
    prefilled: bool = False
    versions: list[list[int]] = field(default_factory=list)  # [version, tokens] runs

    def grow(self, tokens: int, version: int) -> None:
        self.done += tokens
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += tokens
        else:
            self.versions.append([version, tokens])

    def version_at(self, fraction: float) -> int:
        """The version of the token `fraction` of the way through what was generated."""
        at, seen = fraction * self.done, 0
        for version, n in self.versions:
            seen += n
            if at < seen:
                return version
        return self.versions[-1][0] if self.versions else 0


class VirtualBatch:
    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.running: dict[str, Row] = {}
        self.waiting: deque[Row] = deque()
        self.credit = 0.0  # simulated seconds already spent on the next prefill or step
        self.clock = 0.0  # simulated seconds advanced in all
        self.busy = 0.0  # of which with rows to work on

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, row: Row) -> None:
        self.waiting.append(row)
        self._admit()

    def remove(self, rid: str) -> Row | None:
        row = self.running.pop(rid, None)
        if row is None:
            row = next((r for r in self.waiting if r.rid == rid), None)
            if row is not None:
                self.waiting.remove(row)
        self._admit()
        return row

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.spec.max_rows:
            row = self.waiting.popleft()
            self.running[row.rid] = row
        if not self.running:
            self.credit = 0.0

    def _context(self) -> int:
        return sum(self.spec.prompt_tokens + r.done for r in self.running.values())

    def until_next_end(self) -> float:
        """Simulated seconds until the next running row ends (inf: none runs)."""
        if not self.running:
            return math.inf
        spec, rows = self.spec, len(self.running)
        new = sum(not r.prefilled for r in self.running.values())
        t = spec.prefill_s(new) if new else 0.0
        left, ctx = min(r.total - r.done for r in self.running.values()), self._context()
        for i in range(left):
            t += spec.decode_s(rows, ctx + i * rows)
        return max(0.0, t - self.credit)

    def advance(self, sim_s: float, version: int) -> list[Row]:
        """Let `sim_s` simulated seconds pass under weight `version`; the rows that ended."""
        self.clock += sim_s
        if self.running:
            self.busy += sim_s
        t, ended = self.credit + sim_s, []
        while self.running:
            new = [r for r in self.running.values() if not r.prefilled]
            if new:
                cost = self.spec.prefill_s(len(new))
                if t < cost:
                    break
                t -= cost
                for r in new:
                    r.prefilled = True
                continue
            steps, t = self._decode(t)
            if steps == 0:
                break
            for r in self.running.values():
                r.grow(steps, version)
            done = [r for r in self.running.values() if r.done >= r.total]
            for r in done:
                del self.running[r.rid]
            ended += done
            self._admit()
        self.credit = t if self.running else 0.0
        return ended

    def _decode(self, t: float) -> tuple[int, float]:
        """Decode steps that fit in `t` (up to the next row's end), and the time left."""
        rows, ctx = len(self.running), self._context()
        left = min(r.total - r.done for r in self.running.values())
        steps = 0
        while steps < left:
            cost = self.spec.decode_s(rows, ctx + steps * rows)
            if t < cost:
                break
            t -= cost
            steps += 1
        return steps, t
