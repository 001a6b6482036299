"""A bug in the user's environment stops the run with the bug itself (type, message,
file:line) under every strategy: Flattening says so (not "invalid configuration"), and
Separation's generator reports it once rather than dying into runtime.restart_limit
restarts of the same deterministic error."""

from __future__ import annotations

import json

import pytest

from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.strategies.base import UserCodeFailed
from rlhf_async.strategies.separation.startup import PipelineError
from tests.text_model import text_job_files, text_job_overrides

pytestmark = [pytest.mark.timeout(300)]

ENV = '''
class Env:
    async def reset(self, row):
        return ""

    async def step(self, action):
        return {}["tool"], 1.0, True
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return text_job_files(tmp_path_factory.mktemp("envtext"), "env.py", ENV)


def _cfg(files, tmp_path, name, *overrides):
    return load_config(None, [
        *text_job_overrides(files, tmp_path, name),
        f"task.env={json.dumps(str(files / 'env.py') + ':Env')}",
        "generation.max_episode_tokens=12", "generation.stop_strings=[\".\"]",
        "run.eval_prompts=4", *overrides])


def _what(files) -> str:
    return f"step() raised KeyError: 'tool' (at {files / 'env.py'}:7)"


def test_flattening_names_the_environments_exception(files, tmp_path):
    with pytest.raises(UserCodeFailed) as e:
        job.run(_cfg(files, tmp_path, "flat"))
    assert str(e.value).startswith(f"task.env: {str(files / 'env.py') + ':Env'!r}: ")
    assert _what(files) in str(e.value) and "invalid configuration" not in str(e.value)


def test_separation_reports_it_once_without_restarting_the_generator(files, tmp_path):
    with pytest.raises(PipelineError) as e:
        job.run(_cfg(files, tmp_path, "sep", "placement.strategy=separation",
                     "placement.devices=2", "algo.max_staleness=0",
                     "runtime.restart_limit=3"))
    msg = str(e.value)
    assert msg.startswith("gen0: task.env: ") and _what(files) in msg, msg
    assert "died" not in msg and "continue with `rlhf-async resume" in msg
