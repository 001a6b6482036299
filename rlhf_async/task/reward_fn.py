"""The user's rule reward: `task.reward = "module.path:function"` or `"path/to/file.py:function"`,
a callable `(prompt: str, response: str) -> float`.

It is imported once per process (cached by its spec) and every call is checked: an import
error, a missing or non-callable attribute, an exception inside it or a return value that
is not a finite number, a call that calls sys.exit() or runs past `task.reward_timeout_s` is
one `RewardFunctionError` naming the function (and, for a call, the prompt's index in the
prompts file), which the CLI prints as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rlhf_async.config import ConfigError

RewardFn = Callable[[str, str], float]
_LOADED: dict[tuple[str, str], RewardFn] = {}


class RewardFunctionError(ConfigError):
    """The user's reward function cannot be loaded, or one of its calls went wrong."""

    def __init__(self, message: str) -> None:
        super().__init__([f"task.reward: {message}"])


def _split(spec: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise RewardFunctionError(f"{spec!r} is not 'module.path:function' or "
                                  "'path/to/file.py:function'")
    return where, name


def _import(where: str, spec: str) -> object:
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise RewardFunctionError(f"{spec!r}: file {where!r} not found "
                                          f"(relative paths start at {Path.cwd()})")
            name = f"rlhf_async_user_reward_{abs(hash(str(path)))}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            assert mod_spec is not None and mod_spec.loader is not None  # a .py file
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module  # dataclasses and pickling look modules up here
            mod_spec.loader.exec_module(module)
            return module
        # the working directory, as for a file path (the CLI's sys.path does not hold it)
        sys.path.insert(0, str(Path.cwd()))
        try:
            return importlib.import_module(where)
        finally:
            sys.path.remove(str(Path.cwd()))
    except RewardFunctionError:
        raise
    except Exception as e:  # whatever the user's module raises on import
        raise RewardFunctionError(f"cannot import {where!r} for {spec!r}: "
                                  f"{type(e).__name__}: {e}") from None


def load_reward_fn(spec: str) -> RewardFn:
    """The callable named by `spec`, imported on first use in this process."""
    key = (spec, str(Path.cwd()))
    if key in _LOADED:
        return _LOADED[key]
    where, name = _split(spec)
    module = _import(where, spec)
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardFunctionError(f"{spec!r}: {where!r} has no attribute {name!r}")
    if not callable(fn):
        raise RewardFunctionError(f"{spec!r}: {name!r} is a {type(fn).__name__}, "
                                  "not a function")
    _LOADED[key] = fn
    return fn


class _Worker:
    """One daemon thread that runs reward calls, so the caller can stop waiting on one.

    Why a thread and not a subprocess: the reward is called once per sample, in the scorer
    node under Separation (already off its event loop, in `asyncio.to_thread`) and in the
    job's or a rank's own process under Flattening and Interleaving. A thread hand-off costs
    microseconds and shares the imported function with its module state in every one of
    those places; a subprocess would re-import the user's module, pickle every prompt and
    response across, and fork a process that holds torch (unsafe with CUDA). A thread
    cannot be killed, but a call past its deadline ends the run, and a daemon thread does
    not keep the process alive at exit. What only a subprocess would survive: a reward that
    calls os._exit, crashes the interpreter, or blocks in C code holding the GIL.
    """

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[RewardFn, str, str, Future[tuple[bool, Any]]]] = \
            queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward-fn", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, prompt, response, done = self.calls.get()
            try:
                done.set_result((True, fn(prompt, response)))
            except BaseException as e:  # sys.exit() too: the caller reports it
                done.set_result((False, e))


_worker: _Worker | None = None


def _call(fn: RewardFn, prompt: str, response: str, timeout_s: float) -> tuple[bool, Any]:
    """(True, value) or (False, what it raised); TimeoutError past `timeout_s`."""
    global _worker
    if _worker is None:
        _worker = _Worker()
    done: Future[tuple[bool, Any]] = Future()
    _worker.calls.put((fn, prompt, response, done))
    try:
        return done.result(timeout=timeout_s)
    except TimeoutError:
        _worker = None  # stuck in the user's code: the next call gets a fresh thread
        raise


def call_reward(fn: RewardFn, spec: str, prompt: str, response: str, index: int,
                timeout_s: float) -> float:
    """fn(prompt, response) as a finite float within `timeout_s`; one clear error
    otherwise."""
    where = f"prompt {index} of task.prompts" if index >= 0 else "a prompt not in task.prompts"
    try:
        ok, value = _call(fn, prompt, response, timeout_s)
    except TimeoutError:
        raise RewardFunctionError(f"{spec} did not return within task.reward_timeout_s = "
                                  f"{timeout_s:g} s on {where} (prompt {prompt!r}, response "
                                  f"{response!r})") from None
    if not ok and isinstance(value, SystemExit):
        raise RewardFunctionError(f"{spec} called sys.exit({value.code!r}) on {where} "
                                  f"(prompt {prompt!r}); a reward function must return a "
                                  "number, not end the process")
    if not ok:  # the user's code: any failure, one report
        raise RewardFunctionError(f"{spec} raised {type(value).__name__}: {value} on {where} "
                                  f"(prompt {prompt!r}, response {response!r})")
    if not isinstance(value, numbers.Real):  # bools count: True = 1.0
        raise RewardFunctionError(f"{spec} returned {value!r} ({type(value).__name__}) on "
                                  f"{where}; it must return a number")
    if not math.isfinite(float(value)):
        raise RewardFunctionError(f"{spec} returned {value!r} on {where}; it must return a "
                                  "finite number")
    return float(value)
