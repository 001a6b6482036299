"""The environment adapter contract: what an outside package's environments or datasets
supply to the text task when `task.env` or `task.prompts` is written '<prefix>:<argument>'
(the prefix one key of `ADAPTERS`, `task/adapters/__init__.py`).

An adapter is a class made with `(argument, task)` (what follows the prefix; the `[task]`
section) once per process that loads the task, and asked, in this order:
- before anything starts (`prepare_run`, so `run` and --dry-run alike): `problems()`, its
  own checks of the argument and its knobs, cheap and without side effects; then once, in
  the process that starts the job, `check_reachable()`: what it reaches outside this process
  (an app it will serve imports, a URL answers), which may take seconds;
- as the task loads (every rank and node): `rows()` when it `gives_prompts`, `rule()`,
  then `environment()` or `agent(tokenizer)` for its episodes.
Its knobs, when it has any, are the `[task]` table named after its prefix (`task.verifiers`
for 'verifiers:'); the config layer refuses that table without the prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from rlhf_async.config import TaskConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhf_async.modeling.environment import Env
    from rlhf_async.task.agents.agent import AgentEpisodes
    from rlhf_async.task.sources.tokens import Prompt

KEYS = ("env", "prompts")  # the `[task]` keys an adapter may be named in


@dataclass
class Rows:
    """An adapter's prompts: each row's prompt (a string, or a chat with
    `task.chat_template`), its other columns (what its reward, environment or agent reads
    of the row), and which rows are held out for evaluation (None: ~1 in 8 by the prompt's
    hash, as any prompts file's)."""

    prompts: list[Prompt]
    columns: list[dict[str, Any]]
    heldout: list[bool] | None = None


class Scorer(Protocol):
    """A rule reward on decoded responses, as the text task calls `task.reward`'s:
    [B] rewards of (prompt, response) pairs with their rows' columns and row indices (-1:
    not one of the rows)."""

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 columns: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[float]: ...


class EnvironmentAdapter(Protocol):
    key: ClassVar[str]  # "env" or "prompts": the [task] key it is named in (KEYS)
    gives_prompts: ClassVar[bool]  # its rows are the prompts (with key "env": no task.prompts)
    gives_reward: ClassVar[bool]  # it judges responses itself: no task.reward is needed
    preload: ClassVar[tuple[str, ...]]  # slow imports the fork server makes once

    def __init__(self, argument: str, task: TaskConfig) -> None: ...

    def problems(self) -> list[str]:
        """What is wrong with the argument or the knobs, each line naming its key; []
        when nothing is. Cheap: it runs before every job (and --dry-run)."""
        ...

    def check_reachable(self) -> None:
        """What the adapter reaches outside this process, checked once before anything
        starts; a ConfigError saying what is wrong."""
        ...

    def rows(self) -> Rows | None:
        """Its prompts; None from an adapter that gives none (`gives_prompts` False)."""
        ...

    def rule(self) -> Scorer | None:
        """Its reward on decoded responses when `task.reward` is unset; None: its episodes
        give the reward, or it has none."""
        ...

    def environment(self) -> Callable[[], Env] | None:
        """Its episodes as an `Env` made once per episode (observations rendered as the
        chat template's tool turns); None: it plays none this way."""
        ...

    def agent(self, tokenizer: PreTrainedTokenizerBase) -> AgentEpisodes | None:
        """Its episodes as an agent on the policy's endpoint (`task/agents/agent.py`);
        None: it plays none this way."""
        ...
