"""The environment adapter registry (`task/adapters/`): every registered adapter keeps the
contract, none is imported until a job names it, and the registry's own checks say what
is wrong with a prefix before anything reads an adapter's rows."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest

from rlhf_async.config import ConfigError, JobConfig, TaskConfig
from rlhf_async.task.adapters import ADAPTERS, KEYS, EnvironmentAdapter, adapter_problems
from rlhf_async.task.adapters import _load as load_adapter
from rlhf_async.task.text import read_prompts

FLAGS = {"key": str, "gives_prompts": bool, "gives_reward": bool, "preload": tuple}
METHODS = [n for n, v in vars(EnvironmentAdapter).items()
           if inspect.isfunction(v) and not n.startswith("_")]


def test_every_registered_adapter_keeps_the_contract():
    assert set(METHODS) == {"problems", "check_reachable", "rows", "rule", "environment",
                            "agent"}
    assert set(FLAGS) == set(EnvironmentAdapter.__annotations__)
    for prefix, path in ADAPTERS.items():
        cls = load_adapter(path)
        for name, kind in FLAGS.items():
            assert isinstance(getattr(cls, name), kind), (prefix, name)
        assert cls.key in KEYS, prefix
        for name in METHODS:
            ours = inspect.signature(getattr(EnvironmentAdapter, name)).parameters
            theirs = inspect.signature(getattr(cls, name)).parameters
            assert list(theirs) == list(ours), (prefix, name)
        assert list(inspect.signature(cls).parameters) == ["argument", "task"], prefix


def test_no_adapters_package_is_imported_until_a_job_names_it():
    code = ("import sys, rlhf_async.task, rlhf_async.job; "
            "print(sorted(m for m in ('openenv', 'verifiers', 'reasoning_gym') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def _problems(**task: Any) -> list[str]:
    return adapter_problems(JobConfig(task=TaskConfig(name="text", **task)))


def test_the_registry_says_what_is_wrong_with_a_prefix(tmp_path):
    assert _problems(prompts="nosuch:things") == [
        "task.prompts: 'nosuch:things' is neither a file nor a directory nor an adapter's "
        "'<prefix>:<argument>' (prefixes: openenv, reasoning_gym, verifiers)"]
    assert _problems(prompts="openenv:x.app") == [
        "task.prompts: 'openenv:x.app': 'openenv:' names an adapter of task.env, not of "
        "task.prompts"]
    assert _problems(env="verifiers:") == [
        "task.env: 'verifiers:' names no environment; expected 'verifiers:<taskset id>'"]
    assert _problems(env="mymodule:Env") == [
        "task.prompts: task.env = 'mymodule:Env' gives no prompts; set task.prompts (a data "
        "file, a directory or a cached dataset id)"]
    (tmp_path / "p.txt").write_text("a\nb\n")
    assert _problems(env="mymodule:Env", prompts=str(tmp_path / "p.txt")) == []
    assert _problems(prompts="reasoning_gym:basic_arithmetic") == []
    assert adapter_problems(JobConfig(task=TaskConfig(name="sort_digits"))) == []


class Strict:
    """An adapter whose rows assume its argument was checked."""

    key, gives_prompts, gives_reward, preload = "prompts", True, True, ()

    def __init__(self, argument: str, task: TaskConfig) -> None:
        self.argument = argument

    def problems(self) -> list[str]:
        return [] if self.argument.isdigit() else [f"task.prompts: {self.argument!r} is "
                                                   "not a count"]

    def check_reachable(self) -> None:
        """Nothing to reach: its rows are made here."""

    def rows(self) -> Any:
        raise AssertionError("rows() asked before problems() passed")

    def rule(self) -> None:
        return None

    def environment(self) -> None:
        return None

    def agent(self, tokenizer: Any) -> None:
        return None


def test_a_bad_argument_stops_whatever_reads_the_rows_first(monkeypatch):
    monkeypatch.setitem(ADAPTERS, "strict", f"{__name__}:Strict")
    with pytest.raises(ConfigError, match=r"task.prompts: 'many' is not a count"):
        read_prompts(TaskConfig(name="text", prompts="strict:many"))  # as the planner does
