"""What a multi-turn episode talks to: an environment, and how its replies become tokens.

An episode alternates policy turns and environment turns. `reset(row)` opens it (its
observation, when not empty, is the first environment turn), `step(action_text)` answers
each policy turn with (observation, reward, done). The episode's reward is the sum of its
steps' rewards. An environment may also have `async close()`, called once its episode is
over (a server session released). Environments are asyncio objects so that one process can
hold many episodes in flight and await all their calls at once (a tool call, a test run, a
web request).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Env(Protocol):
    """One episode's environment (a fresh object per episode).

    `reset` receives the prompt's row: {"prompt": text, "seed": int, ...the row's other
    columns}; "seed" is keyed by (run seed, step, sample id), so an environment that draws
    from it behaves the same wherever and however often its episode runs."""

    async def reset(self, row: dict[str, Any]) -> str: ...

    async def step(self, action: str) -> tuple[str, float, bool]: ...


@dataclass(frozen=True)
class EpisodeSpec:
    """How a task's episodes run (`SamplingParams.episode`); None there = one response."""

    make_env: Callable[[], Env]  # a fresh environment for each episode
    row: Callable[[list[int]], dict[str, Any]]  # a prompt's token ids -> its row for reset
    # an observation -> the tokens an environment turn appends: the chat template's delta
    # for that message (its markup and the next generation prompt), tokenised once
    render: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]  # a policy turn's tokens -> the action text
    max_turns: int  # policy turns per episode
    max_tokens: int  # tokens of an episode after its prompt (both sides), the response width
    timeout_s: float  # longest one reset/step call may take; past it the episode ends
    name: str = "env"  # for logs and errors
    # runs the episodes itself (an agent's, `task/agents/agent.py`): called as `play` is, with the
    # same policy turn; None = `play`'s reset/step loop over `make_env`'s environments
    driver: Callable[..., Awaitable[list[Any]]] | None = None
