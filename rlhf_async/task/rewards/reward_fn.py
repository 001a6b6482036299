"""The user's rule reward: `task.reward = "module.path:function"` or `"path/to/file.py:function"`,
a callable `(prompt: str, response: str, **columns) -> float`, or with
`task.reward_batched = true` `(prompts: list[str], responses: list[str], **columns: list)
-> list[float]` (TRL's convention). `columns` are the prompt row's other columns (a GSM8K
answer, a test case, ...); the function gets those it names, or all with `**kwargs`.

It is imported once per process (cached by its spec) and every call is checked: an import
error, a missing or non-callable attribute, an exception inside it or a return value that
is not a finite number (for a batch: not one per response), a call that calls sys.exit() or
runs past `task.reward_timeout_s` is one `RewardFunctionError` naming the function (and,
for a call, the prompt's index in the prompts file), which the CLI prints as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rlhf_async.config import ConfigError

RewardFn = Callable[..., Any]
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

    Why a thread and not a subprocess: the reward is called once per sample (or batch), in
    the scorer node under Separation (already off its event loop, in `asyncio.to_thread`)
    and in the job's or a rank's own process under Flattening and Interleaving. A thread
    hand-off costs microseconds and shares the imported function with its module state in
    every one of those places; a subprocess would re-import the user's module, pickle every
    prompt and response across, and fork a process that holds torch (unsafe with CUDA). A
    thread cannot be killed, but a call past its deadline ends the run, and a daemon thread
    does not keep the process alive at exit. What only a subprocess would survive: a reward
    that calls os._exit, crashes the interpreter, or blocks in C code holding the GIL.
    """

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[RewardFn, tuple, dict, Future[tuple[bool, Any]]]] \
            = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward-fn", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, kwargs, done = self.calls.get()
            try:
                done.set_result((True, fn(*args, **kwargs)))
            except BaseException as e:  # sys.exit() too: the caller reports it
                done.set_result((False, e))


_worker: _Worker | None = None


def _call(fn: RewardFn, args: tuple, kwargs: dict, timeout_s: float) -> tuple[bool, Any]:
    """(True, value) or (False, what it raised); TimeoutError past `timeout_s`."""
    global _worker
    if _worker is None:
        _worker = _Worker()
    done: Future[tuple[bool, Any]] = Future()
    _worker.calls.put((fn, args, kwargs, done))
    try:
        return done.result(timeout=timeout_s)
    except TimeoutError:
        _worker = None  # stuck in the user's code: the next call gets a fresh thread
        raise


def _checked_call(fn: RewardFn, spec: str, args: tuple, kwargs: dict, where: str,
                  shown: str, timeout_s: float) -> Any:
    """fn(*args, **kwargs)'s value; one RewardFunctionError for a timeout, sys.exit or an
    exception (`where`: which call; `shown`: its inputs, for the message)."""
    try:
        ok, value = _call(fn, args, kwargs, timeout_s)
    except TimeoutError:
        raise RewardFunctionError(f"{spec} did not return within task.reward_timeout_s = "
                                  f"{timeout_s:g} s on {where} ({shown})") from None
    if not ok and isinstance(value, SystemExit):
        raise RewardFunctionError(f"{spec} called sys.exit({value.code!r}) on {where} "
                                  f"({shown}); a reward function must "
                                  "return a number, not end the process")
    if not ok:  # the user's code: any failure, one report
        raise RewardFunctionError(f"{spec} raised {type(value).__name__}: {value} on {where} "
                                  f"({shown})")
    return value


def _number(value: Any, spec: str, where: str) -> float:
    if not isinstance(value, numbers.Real):  # bools count: True = 1.0
        raise RewardFunctionError(f"{spec} returned {value!r} ({type(value).__name__}) on "
                                  f"{where}; it must return a number")
    if not math.isfinite(float(value)):
        raise RewardFunctionError(f"{spec} returned {value!r} on {where}; it must return a "
                                  "finite number")
    return float(value)


def _where(index: int, rows: str = "task.prompts") -> str:
    return f"prompt {index} of {rows}" if index >= 0 else f"a prompt not in {rows}"


def call_reward(fn: RewardFn, spec: str, prompt: str, response: str, index: int,
                timeout_s: float, columns: dict[str, Any] | None = None,
                rows: str = "task.prompts") -> float:
    """fn(prompt, response, **columns) as a finite float within `timeout_s`; one clear
    error otherwise (naming prompt `index` of `rows`)."""
    where = _where(index, rows)
    value = _checked_call(fn, spec, (prompt, response), columns or {}, where,
                          f"prompt {prompt!r}, response {response!r}", timeout_s)
    return _number(value, spec, where)


def _column_names(fn: RewardFn) -> set[str] | None:
    """The keyword arguments `fn` takes beyond its first two: None = any (**kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: no columns
        return set()
    kinds = inspect.Parameter
    if any(p.kind is kinds.VAR_KEYWORD for p in params):
        return None
    named = (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    return {p.name for p in params[2:] if p.kind in named}


class RuleReward:
    """The user's rule, loaded: called per sample, or once per batch (`batched`), with the
    prompt rows' columns it takes. Its errors name a prompt by its index in `rows` (what
    the indices it is given count: task.prompts, a request to `rlhf-async serve-reward`)."""

    def __init__(self, fn: RewardFn, spec: str, batched: bool, timeout_s: float,
                 rows: str = "task.prompts") -> None:
        self.fn, self.spec, self.batched, self.timeout_s = fn, spec, batched, timeout_s
        self.takes, self.rows = _column_names(fn), rows

    @classmethod
    def load(cls, spec: str, batched: bool, timeout_s: float,
             rows: str = "task.prompts") -> RuleReward:
        return cls(load_reward_fn(spec), spec, batched, timeout_s, rows)

    def _kwargs(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if self.takes is None or k in self.takes}

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 columns: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[float]:
        """One finite reward per response; `columns[b]` and `indices[b]` are row b's prompt
        row (its columns; its index in task.prompts, -1 when not one of them)."""
        if not self.batched:
            return [call_reward(self.fn, self.spec, p, r, i, self.timeout_s, self._kwargs(c),
                                self.rows)
                    for p, r, c, i in zip(prompts, responses, columns, indices, strict=True)]
        names = sorted({k for c in columns for k in self._kwargs(c)})
        kwargs = {k: [c.get(k) for c in columns] for k in names}
        n, first = len(prompts), next(iter(indices), -1)
        where = f"a batch of {n} responses (the first to {_where(first, self.rows)})"
        value = _checked_call(self.fn, self.spec, (list(prompts), list(responses)), kwargs,
                              where, f"first prompt {prompts[0]!r}" if n else "",
                              self.timeout_s)
        if hasattr(value, "tolist"):  # a tensor or an array
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{len(value)} values" if isinstance(value, (list, tuple)) else \
                f"{type(value).__name__}"
            raise RewardFunctionError(f"{self.spec} returned {got} for {where}; with "
                                      "task.reward_batched it must return a list of one "
                                      f"number per response ({n})")
        return [_number(v, self.spec, _where(i, self.rows))
                for v, i in zip(value, indices, strict=True)]
