"""`task.agent`: checked with the rest of the config, loaded with one clear error per
mistake, and run as the text task's episodes."""

from __future__ import annotations

import json

import pytest

from rlhf_async.config import ConfigError, load_config
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.agents.agent import AgentEpisodes, load_agent
from tests.unit.task.test_task_text import cfg_for, files  # noqa: F401  (files: a fixture)

AGENT = "async def run(base_url, row):\n    return 1.0\n\ndef sync(base_url, row):\n    return 1.0\n"


def _agent(files, name="run"):  # noqa: F811  (the imported fixture)
    (files / "agent.py").write_text(AGENT)
    return f"task.agent={json.dumps(str(files / 'agent.py') + ':' + name)}"


def test_an_agent_runs_the_text_tasks_episodes(files):  # noqa: F811
    cfg = cfg_for(files, _agent(files), "task.agent_timeout_s=5", fn=None)
    spec = sampling_params(cfg, make_task(cfg)).episode
    assert spec is not None and isinstance(spec.driver, AgentEpisodes)
    assert spec.timeout_s == 5.0 and spec.name.endswith("agent.py:run")


def test_an_agents_prompt_batch_is_task_max_prompt_tokens_wide(files):  # noqa: F811
    """An agent renders its own prompt (system turn, examples), longer than the data's:
    `task.max_prompt_tokens` is its room, so none of it spills into the episode's tokens."""
    task = make_task(cfg_for(files, _agent(files), fn=None))  # task.max_prompt_tokens=32
    assert task.prompt_batch(0, "train", 0, count=2, group_size=1).prompt_ids.shape[1] == 32
    plain = make_task(cfg_for(files))  # no agent: the data's longest, the least to compute
    assert plain.prompt_batch(0, "train", 0, count=2, group_size=1).prompt_ids.shape[1] < 32


@pytest.mark.parametrize(("more", "match"), [
    (['task.env="calculator"'], "beside task.env = 'calculator'.*set only one"),
    (['task.reward="x.py:f"'], r"task.reward: 'x.py:f' would never be called: with "
                               "task.agent"),
    (["generation.partial_rollout=true", "placement.strategy=separation"],
     "partial_rollout: not supported with multi-turn episodes"),
    (["task.agent_timeout_s=100", "runtime.step_deadline_s=60"],
     "task.agent_timeout_s: 100 must be under runtime.step_deadline_s = 60"),
])
def test_what_cannot_go_with_an_agent_is_refused(files, more, match):  # noqa: F811
    with pytest.raises(ConfigError, match=match):
        cfg_for(files, _agent(files), *more, fn=None)


def test_an_agent_plays_the_text_or_the_calculator_tasks_episodes(files):  # noqa: F811
    assert load_config(None, ["task.name=calculator", _agent(files)]).task.agent
    with pytest.raises(ConfigError, match="'sort_digits' has no episodes"):
        load_config(None, ["task.name=sort_digits", _agent(files)])


@pytest.mark.parametrize(("spec", "match"), [
    ("nocolon", "expected 'file.py:function'"),
    ("{dir}/missing.py:run", "not found"),
    ("{dir}/agent.py:sync", "not a coroutine function"),
    ("{dir}/agent.py:other", "has no attribute 'other'"),
])
def test_a_wrong_agent_is_one_clear_error(files, spec, match):  # noqa: F811
    (files / "agent.py").write_text(AGENT)
    with pytest.raises(ConfigError, match=match) as e:
        load_agent(spec.format(dir=files))
    assert all(p.startswith("task.agent: ") for p in e.value.problems)
