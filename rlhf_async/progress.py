"""Progress of the long phases of a job (SFT, reward model, evaluation, RL) on stderr.

On a terminal: a tqdm bar with rate and ETA, metrics in its postfix. Anywhere else (a log
file, CI, the daemon): one plain line when the phase starts, then one every `every_s`
seconds and one at the end, so a log shows life without one line per step. Disabled
(`run.progress = false`): nothing. Progress is for people; the numbers are in metrics.jsonl.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Any, Self

from tqdm import tqdm

PLAIN_EVERY_S = 5.0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def announce(name: str, text: str, *, enabled: bool = True,
             stream: IO[str] | None = None) -> None:
    """One line about a phase that has nothing to count (e.g. skipped: cached)."""
    if enabled:
        out = stream or sys.stderr
        out.write(f"[{name}] {text}\n")
        out.flush()


class Phase:
    def __init__(self, name: str, total: int, *, enabled: bool = True,
                 stream: IO[str] | None = None, every_s: float = PLAIN_EVERY_S,
                 unit: str = "step") -> None:
        self.name, self.total, self.enabled, self.every_s = name, total, enabled, every_s
        self.stream = stream or sys.stderr
        self.done, self.t0 = 0, time.perf_counter()
        self.postfix: dict[str, Any] = {}
        self.bar: tqdm | None = None
        self._last_line = float("-inf")
        if not enabled:
            return
        if self.stream.isatty():
            self.bar = tqdm(total=total, desc=name, unit=unit, file=self.stream,
                            dynamic_ncols=True, leave=True)
        else:
            self._line()

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if postfix:
            self.postfix = postfix
        if not self.enabled:
            return
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix_str(" | ".join(f"{k} {_fmt(v)}" for k, v in postfix.items()),
                                         refresh=False)
            self.bar.update(n)
        elif time.perf_counter() - self._last_line >= self.every_s or self.done >= self.total:
            self._line()

    def note(self, text: str) -> None:
        """One line about the phase (an evaluation's result), above a terminal's bar."""
        if not self.enabled:
            return
        line = f"[{self.name}] {text}"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _line(self) -> None:
        self._last_line = now = time.perf_counter()
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 and self.done else 0.0
        eta = f", eta {(self.total - self.done) / rate:.0f}s" if rate else ""
        metrics = "".join(f" | {k} {_fmt(v)}" for k, v in self.postfix.items())
        self.stream.write(f"[{self.name} {elapsed:6.1f}s] {self.done}/{self.total} "
                          f"({rate:.1f}/s{eta}){metrics}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.done and time.perf_counter() - self._last_line > 0.0 \
                and self.done < self.total:
            self._line()  # stopped early: say where

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
