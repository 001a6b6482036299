"""A tiny OpenEnv environment server: guess a digit (0-9) drawn from the reset's seed. Each
step reads the first digit of the policy's text and answers "higher", "lower" or
"correct" (done); a reply without a digit is told to give one.

A step's reward is how much nearer this reply is than the one before (`value`: 1 for the
digit, 0.5 * (1 - distance / 9) for another digit, 0 for no digit), so an episode's reward
(its steps' sum) is its last reply's value: 1 when it found the digit, else more the
nearer it ended. A wrong guess still earns something, so a group of replies differs in
reward long before one of them is correct (a 0/1 reward gave a small model nothing to
learn from), and following the hints is what brings a guess nearer.

Serve it:  python -m uvicorn examples.openenv_guess.server:app --port 8000
Train on it (started locally by the run, or reached at its URL):
    rlhf-async run task.name=text ... task.env=openenv:examples.openenv_guess.server:app
    rlhf-async run task.name=text ... task.env=openenv:http://127.0.0.1:8000
"""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

OPENING = "I picked a digit from 0 to 9. Guess it: reply with one digit."


class GuessAction(Action):
    guess: str = Field(..., description="the policy's guess: text holding a digit")


class GuessObservation(Observation):
    text: str = Field(default="", description="what the environment says")


def value(guess: int | None, target: int) -> float:
    """What a reply is worth: 1 for the digit, less the farther another digit is, 0 for
    none."""
    if guess is None:
        return 0.0
    return 1.0 if guess == target else 0.5 * (1.0 - abs(guess - target) / 9.0)


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def __init__(self) -> None:
        self._state, self._target, self._value = State(step_count=0), 0, 0.0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._target, self._value = random.Random(seed).randrange(10), 0.0
        return GuessObservation(text=OPENING, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None,  # type: ignore[override]
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = [int(c) for c in action.guess if c.isdigit()]
        guess = digits[0] if digits else None
        now = value(guess, self._target)
        reward, self._value = now - self._value, now
        if guess is None:
            text = "That has no digit. Reply with one digit from 0 to 9."
        elif guess == self._target:
            text = f"Correct: my digit is {guess}."
        else:
            side = "higher" if guess < self._target else "lower"
            text = f"Wrong: my digit is {side} than {guess}. Guess again."
        return GuessObservation(text=text, done=guess == self._target, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=256)
