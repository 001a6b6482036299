"""The text task with the user's environment (`task.env`): its episodes through the
tokenizer's chat template, its rewards as the rule reward."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_async.config import ConfigError
from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.rollout import ENV
from rlhf_async.rl.scoring import RewardMix
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import load_sft
from tests.unit.task.test_task_text import cfg_for, files  # noqa: F401  (files: a fixture)

ENV_CODE = '''
class Env:
    async def reset(self, row):
        self.prompt, self.turn = row["prompt"], 0
        return ""

    async def step(self, action):
        self.turn += 1
        return "yes", 0.25, self.turn >= 2
'''


def test_episodes_of_the_users_environment(files):  # noqa: F811  (the imported fixture)
    (files / "env.py").write_text(ENV_CODE)
    cfg = cfg_for(files, f"task.env={json.dumps(str(files / 'env.py') + ':Env')}",
                  "task.max_turns=3", "generation.max_episode_tokens=24",
                  f"generation.stop_token_ids={json.dumps(list(range(6, 35)))}", fn=None)
    task = make_task(cfg)
    params = sampling_params(cfg, task)
    assert params.episode is not None and params.episode.max_tokens == 24
    tok = task.tokenizer  # type: ignore[attr-defined]
    # the template ("<user> {content}" per message, " <bot>" to answer) adds the tool turn
    assert params.episode.render("yes") == tok.convert_tokens_to_ids(["<user>", "yes", "<bot>"])
    prompts = task.prompt_batch(0, "train", 0, 4, 2)
    b = rollout(load_sft(files / "model"), prompts, params, seed=0, step=0, version=0)
    assert b.response_ids.shape[1] == 24 and (b.response_mask == ENV).any()
    assert b.env_rewards is not None and set(b.env_rewards.tolist()) <= {0.0, 0.25, 0.5}
    rewards, _ = RewardMix(task.hidden_scores).combine(None, b)
    assert torch.equal(rewards, b.env_rewards)  # the environment's reward is the rule's
    turns = b.turns(task.decode)
    assert all(row[0]["role"] == "prompt" for row in turns)
    assert {t["role"] for row in turns for t in row} == {"prompt", "policy", "environment"}


def _env_cfg(files, *more):  # noqa: F811
    (files / "env.py").write_text(ENV_CODE)
    return cfg_for(files, f"task.env={json.dumps(str(files / 'env.py') + ':Env')}",
                   "task.max_turns=3", "generation.max_episode_tokens=24", *more)


def test_the_environment_gives_the_reward_and_task_reward_beside_it_is_refused(files):  # noqa: F811
    with pytest.raises(ConfigError, match=r"task.reward: .* would never be called"):
        _env_cfg(files)  # cfg_for sets a task.reward
    assert _env_cfg(files, 'task.reward=""').task.reward == ""


def test_an_environment_without_chat_template_takes_plain_text_turns(files):  # noqa: F811
    cfg = _env_cfg(files, 'task.reward=""', "task.chat_template=false",
                   f"generation.stop_token_ids={json.dumps(list(range(6, 35)))}")
    task = make_task(cfg)
    params = sampling_params(cfg, task)
    tok = task.tokenizer  # type: ignore[attr-defined]
    assert params.episode is not None
    assert params.episode.render("yes") == list(tok("\nyes\n", add_special_tokens=False)
                                                .input_ids)
    b = rollout(load_sft(files / "model"), task.prompt_batch(0, "train", 0, 2, 2), params,
                seed=0, step=0, version=0)
    assert b.env_rewards is not None and b.episode_ends is not None
