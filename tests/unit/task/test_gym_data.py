"""`task.prompts = "reasoning_gym:<dataset>"`: prompts drawn from a reasoning-gym dataset
(held out by a disjoint seed), answers scored by the dataset's own scorer."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from rlhf_async.config import ConfigError, load_config
from rlhf_async.task import make_task
from rlhf_async.task.adapters.reasoning_gym import GymScore
from rlhf_async.task.text import TextTask
from tests.text_model import make_text_model

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("gym") / "model", positions=256)


def _cfg(model, *more, gym='{size = 16, seed = 3}'):
    return load_config(None, [f"model.path={json.dumps(str(model))}", "task.name=text",
                              "task.prompts=reasoning_gym:basic_arithmetic",
                              f"task.reasoning_gym={gym}", "generation.max_new_tokens=4",
                              *more])


def test_prompts_come_from_the_dataset_and_its_scorer_is_the_reward(model):
    import reasoning_gym

    task = make_task(_cfg(model))
    assert isinstance(task, TextTask) and isinstance(task.rule, GymScore)
    assert len(task.train_idx) == 16 and len(task.eval_idx) == 2  # size // 8 from seed + 1
    train = reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=3)
    held = reasoning_gym.create_dataset("basic_arithmetic", size=2, seed=4)
    assert [task.prompts[i][-1]["content"] for i in task.train_idx] == \
        [e["question"] for e in train]
    assert [task.prompts[i][-1]["content"] for i in task.eval_idx] == \
        [e["question"] for e in held]
    assert task.prompts[0][0]["role"] == "system"  # reasoning-gym's own default prompt
    i, j = task.train_idx[0], task.eval_idx[0]
    answers = [train[0]["answer"], held[0]["answer"]]
    responses = [f"thinking <answer>{answers[0]}</answer>", answers[1], "<answer>x</answer>"]
    got = task.rule(["p"] * 3, responses, [task.columns[i], task.columns[j],
                                           task.columns[i]], [i, j, i])
    assert got == [1.0, 1.0, 0.0]


def test_system_prompt_picks_one_of_reasoning_gyms_by_name(model):
    import reasoning_gym

    task = make_task(_cfg(model, gym='{size = 16, seed = 3, system_prompt = "direct"}'))
    assert isinstance(task, TextTask)
    assert task.prompts[0][0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS["direct"]
    with pytest.raises(ConfigError, match="system_prompt = 'terse'.*accepted: .*direct"):
        make_task(_cfg(model, gym='{size = 16, system_prompt = "terse"}'))


def test_hidden_scores_read_the_dataset_entry_of_each_prompt(model):
    task = make_task(_cfg(model))
    assert isinstance(task, TextTask)
    b = task.prompt_batch(0, "eval", 0, 2, 1)
    eos = torch.full((2, 1), task.eos_id)  # empty responses: no answer, score 0
    assert task.hidden_scores(b.prompt_ids, eos, torch.ones(2, 1)).tolist() == [0.0, 0.0]


def test_an_unknown_dataset_lists_accepted_names(model):
    cfg = load_config(None, [f"model.path={json.dumps(str(model))}", "task.name=text",
                             "task.prompts=reasoning_gym:no_such_thing"])
    with pytest.raises(ConfigError, match=r"'no_such_thing' is not a reasoning-gym dataset; "
                                          r"accepted: .*basic_arithmetic"):
        make_task(cfg)


def test_a_config_the_dataset_refuses_is_one_error(model):
    with pytest.raises(ConfigError, match=r"task.reasoning_gym: the 'basic_arithmetic' "
                                          r"dataset refuses \{'bogus': 1\}"):
        make_task(_cfg(model, gym='{bogus = 1}'))


def test_without_the_extra_one_error_says_what_to_install(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install "
                                          r"'rlhf-async\[reasoning-gym\]'"):
        make_task(_cfg(model))


def test_the_table_is_only_for_a_reasoning_gym_source(model, tmp_path):
    (tmp_path / "p.txt").write_text("a\nb\n")
    with pytest.raises(ConfigError, match=r"task.reasoning_gym: configures the "
                                          r"'reasoning_gym:' adapter; task.prompts is"):
        load_config(None, [f"model.path={json.dumps(str(model))}", "task.name=text",
                           f"task.prompts={json.dumps(str(tmp_path / 'p.txt'))}",
                           "task.reward=x.py:f", "task.reasoning_gym={size = 4}"])
