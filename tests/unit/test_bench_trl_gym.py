"""bench/trl_gym.py: the dataset's scorer as TRL's reward, row by row, and its config check."""

from __future__ import annotations

import json

import pytest

from bench import trl_gym
from rlhf_async.config import load_config
from rlhf_async.task import make_task
from rlhf_async.task.text import TextTask
from tests.text_model import make_text_model

pytest.importorskip("reasoning_gym")


def test_gym_reward_scores_each_row_against_its_own_question(tmp_path):
    model = make_text_model(tmp_path / "model", positions=256)
    cfg = load_config(None, [f"model.path={json.dumps(str(model))}", "task.name=text",
                             "task.prompts=reasoning_gym:basic_arithmetic",
                             "task.reasoning_gym={size = 8, seed = 3}"])
    task = make_task(cfg)
    assert isinstance(task, TextTask)
    i, j = task.train_idx[0], task.eval_idx[0]
    a_i, a_j = (task.columns[k]["entry"]["answer"] for k in (i, j))
    reward = trl_gym.GymReward(task)
    assert a_i != a_j  # so each row is scored against its own question
    out = reward([[]] * 3, [[{"role": "assistant", "content": f"<answer>{a_i}</answer>"}],
                            a_j, "<answer>x</answer>"],
                 [[1, 2], [3], [4, 5, 6]], row=[i, j, i])
    assert out == [1.0, 1.0, 0.0]
    assert reward.hidden == [sum(out) / 3] and reward.tokens == [6.0]


def test_trl_gym_refuses_a_task_that_is_not_reasoning_gym(tmp_path, capsys):
    cfg = tmp_path / "text.toml"
    cfg.write_text('[task]\nname = "sort_digits"\n')
    assert trl_gym.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "reasoning_gym:<dataset>" in err and "Traceback" not in err
