"""A tiny OpenEnv environment server: guess a digit (0-9) drawn from the reset's seed; each
step answers "higher", "lower" or "correct" (reward 1, done).

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


class GuessAction(Action):
    guess: str = Field(..., description="the policy's guess: text holding a digit")


class GuessObservation(Observation):
    text: str = Field(default="", description="what the environment says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def __init__(self) -> None:
        self._state, self._target = State(step_count=0), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._target = random.Random(seed).randrange(10)
        return GuessObservation(text="Guess my digit (0-9).", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None,  # type: ignore[override]
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = [int(c) for c in action.guess if c.isdigit()]
        if not digits:
            return GuessObservation(text="no digit", done=False, reward=0.0)
        if digits[0] == self._target:
            return GuessObservation(text="correct", done=True, reward=1.0)
        hint = "higher" if digits[0] < self._target else "lower"
        return GuessObservation(text=hint, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=256)
