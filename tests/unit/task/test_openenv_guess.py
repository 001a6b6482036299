"""The OpenEnv example (`examples/openenv_guess/`): its server's game and rewards, its
prompts (the same game, some held out), and the command its README shows (one command, in
the example's README and the how-to, whose keys all load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_async.config import load_config
from rlhf_async.task.text import heldout_split
from tests.example_commands import readme_command
from tests.text_model import make_text_model

pytest.importorskip("openenv")
from examples.openenv_guess import make_prompts
from examples.openenv_guess.server import GuessAction, GuessEnvironment, value

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "openenv_guess"
HOWTO = EXAMPLE.parents[1] / "docs" / "howto" / "openenv.md"


def play(seed: int, *replies: str) -> tuple[int, list[float], list[str], bool]:
    """(the target, each step's reward, each observation, done) of one episode."""
    env = GuessEnvironment()
    env.reset(seed=seed)
    rewards, texts, done = [], [], False
    for r in replies:
        obs = env.step(GuessAction(guess=r))
        rewards.append(float(obs.reward or 0.0))
        texts.append(obs.text)
        done = obs.done
    return env._target, rewards, texts, done


def test_an_episodes_reward_is_its_last_replys_value():
    target = play(3)[0]
    low, high = (target + 1) % 10, (target + 2) % 10
    _, rewards, texts, done = play(3, f"I guess {low}.", "no idea", f"{high}")
    assert not done
    assert rewards[0] == pytest.approx(value(low, target)) and rewards[0] > 0
    assert rewards[1] == pytest.approx(-value(low, target))  # a reply without a digit: 0
    assert sum(rewards) == pytest.approx(value(high, target))
    assert "no digit" in texts[1]
    _, rewards, texts, done = play(3, str(low), str(target))
    assert done and sum(rewards) == pytest.approx(1.0) and texts[-1].startswith("Correct")


def test_a_nearer_guess_is_worth_more_and_the_hint_points_to_the_digit():
    assert value(4, 4) == 1.0 and value(None, 4) == 0.0
    assert value(3, 4) > value(1, 4) > value(8, 0) > value(9, 0) == 0.0
    for seed in range(20):
        target = play(seed)[0]
        for guess in range(10):
            text = play(seed, f"{guess}")[2][0]
            if guess < target:
                assert f"higher than {guess}" in text
            elif guess > target:
                assert f"lower than {guess}" in text


def test_the_prompts_are_the_game_and_some_are_held_out(tmp_path, monkeypatch):
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    monkeypatch.setattr(make_prompts, "__file__", str(tmp_path / "make_prompts.py"))
    make_prompts.main()
    assert (tmp_path / "prompts.jsonl").read_text() == (EXAMPLE / "prompts.jsonl").read_text()
    prompts = [r["prompt"] for r in rows]
    assert len(set(prompts)) == len(prompts)
    assert all("digit" in p and "0" in p and "9" in p for p in prompts)
    train, held = heldout_split(prompts)
    assert len(held) >= 8 and len(train) >= 100


def test_the_readme_and_the_howto_show_one_command_and_it_loads(tmp_path):
    args = readme_command(EXAMPLE / "README.md")
    assert args == readme_command(HOWTO)
    # the model `prepare-smollm2` writes is not in a fresh checkout: a tiny one in its place
    model = make_text_model(tmp_path / "model")
    cfg = load_config(None, [a if not a.startswith("model.path=") else f"model.path={model}"
                             for a in args])
    assert "model.path=runs/models/smollm2-135m-instruct" in args
    assert cfg.task.prompts == "examples/openenv_guess/prompts.jsonl"
    assert cfg.task.env == "openenv:examples.openenv_guess.server:app"
    assert (EXAMPLE.parents[1] / cfg.task.prompts).is_file()
