"""Calling a user's environment or agent from synchronous code: one event loop for every
call of this process, a deadline per call (`task.env_timeout_s`), what it returns checked,
and the errors that stop a run (`EnvError`, naming where in the user's code it raised) or
only warn, repeats counted.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections import Counter
from collections.abc import Awaitable
from typing import Any, TypeVar

from rlhf_async.log import get_logger
from rlhf_async.modeling.environment import EpisodeSpec

log = get_logger(component="episodes")
T = TypeVar("T")


class EnvError(RuntimeError):
    """An environment's reset or step raised, or answered something of the wrong type: the
    user's environment is wrong, and running it again would repeat it, so the run stops
    with this (the exception's type, message and where in the user's code it was raised)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"task.env: {message}")


def where(e: BaseException) -> str:
    """' (at file.py:LINE)': the innermost frame of the exception's traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno})"


class _Warnings:
    """Repeated environment warnings as counts: the first of each kind is logged, then one
    line per `every` more, with the count so far (a hanging environment would otherwise
    print a line per call)."""

    def __init__(self, every: int = 100) -> None:
        self.every, self.counts = every, Counter[tuple[str, str]]()

    def warn(self, event: str, env: str, **fields: Any) -> None:
        self.counts[event, env] += 1
        n = self.counts[event, env]
        if n == 1 or n % self.every == 0:
            log.warning(event, env=env, count=n, **fields)


_WARN = _Warnings()


def warn(event: str, env: str, **fields: Any) -> None:
    """A warning about a user's environment or agent, repeats counted (`_Warnings`)."""
    _WARN.warn(event, env, **fields)


class _EnvLoop:
    """One event loop on a daemon thread for every environment call of this process: the
    callers are synchronous (a rank's loop, a generator's worker thread) and may run inside
    another loop, where `asyncio.run` is not allowed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="env-loop", daemon=True).start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(_as_coro(coro), self.loop).result()


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


_LOOP: list[_EnvLoop] = []
_LOOP_LOCK = threading.Lock()


def env_loop() -> _EnvLoop:
    with _LOOP_LOCK:
        if not _LOOP:
            _LOOP.append(_EnvLoop())
        return _LOOP[0]


async def call(spec: EpisodeSpec, what: str, aw: Awaitable[Any]) -> tuple[bool, Any]:
    """(finished in time, its value). Past `spec.timeout_s` the call is abandoned (its
    episode ends); an exception is the environment's bug and stops the run, named."""
    try:
        return True, await asyncio.wait_for(aw, spec.timeout_s)
    except TimeoutError:
        _WARN.warn("environment call timed out; its episode ends", spec.name, call=what,
                   timeout_s=spec.timeout_s)
        return False, None
    except Exception as e:  # whatever the user's environment raises
        raise EnvError(f"{spec.name!r}: {what}() raised {type(e).__name__}: {e}"
                       f"{where(e)}") from e


def timed_out(spec: EpisodeSpec, what: str) -> str:
    return f"{spec.name}: {what}() took longer than {spec.timeout_s:g} s (task.env_timeout_s)"


def checked_reset(spec: EpisodeSpec, out: Any) -> str:
    if out is None:
        return ""
    if not isinstance(out, str):
        raise EnvError(f"{spec.name!r}: reset() must return the first observation as str "
                       f"('' or None for none), got {type(out).__name__} {str(out)[:80]!r}")
    return out


def checked_step(spec: EpisodeSpec, out: Any) -> tuple[str, float, bool]:
    ok = (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str)
          and isinstance(out[1], int | float) and not isinstance(out[1], bool))
    if not ok:
        raise EnvError(f"{spec.name!r}: step() must return (observation: str, reward: "
                       f"float, done: bool), got {str(out)[:120]!r}")
    return out[0], float(out[1]), bool(out[2])
