"""Loading the user's environment (`task.env`) with one clear error for each mistake."""

from __future__ import annotations

import pytest

from rlhf_async.config import ConfigError
from rlhf_async.task.agents.environment import load_env
from rlhf_async.task.calculator import CalculatorEnv

GOOD = """
class Env:
    async def reset(self, row):
        return ""
    async def step(self, action):
        return "", 1.0, True
"""
SYNC = GOOD.replace("async def step", "def step")


def _file(tmp_path, text, name="env.py"):
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_built_in_and_user_environments_load(tmp_path):
    assert load_env("calculator") is CalculatorEnv
    cls = load_env(f"{_file(tmp_path, GOOD)}:Env")
    assert cls.__name__ == "Env"


@pytest.mark.parametrize(("spec", "text", "match"), [
    ("nosuch", None, "neither a built-in environment"),
    ("{dir}/missing.py:Env", None, "not found"),
    ("{file}:Other", GOOD, "has no attribute 'Other'"),
    ("{file}:Env", SYNC, "missing or not async: step"),
    ("{file}:Env", "def Env():\n    pass\n", "it is not a class"),
    ("{file}:Env", "raise RuntimeError('boom')\n", "RuntimeError: boom"),
])
def test_a_wrong_environment_is_one_clear_error(tmp_path, spec, text, match):
    path = _file(tmp_path, text, f"env_{abs(hash((spec, text)))}.py") if text else ""
    spec = spec.format(dir=tmp_path, file=path)
    with pytest.raises(ConfigError, match=match) as e:
        load_env(spec)
    assert all(p.startswith("task.env: ") for p in e.value.problems)
