"""verifiers environments as `task.env = "verifiers:<environment>"`: an installed verifiers
(v1) environment, its tasks the text task's prompts, each episode played by the
environment's own harness with its model client pointed at the policy's OpenAI-compatible
endpoint, its rubric's score the episode's reward.

<environment> is a verifiers taskset id: an installed package (or a module on the Python
path) exporting its `Taskset` via `__all__`, or one built into verifiers. `task.verifiers`
is the rest of verifiers' `[env]` block (`taskset = {...its knobs}`, `agent = {harness,
runtime, timeout, max_turns, ...}`, a paired env `id`, ...) plus `select` (verifiers'
`SelectConfig`: include, exclude, shuffle, seed, skip, limit), which bounds the tasks read.
A role without a `runtime` runs its harness in verifiers' `subprocess` runtime (verifiers'
own default is a remote Prime sandbox, which cannot reach a local endpoint).

- prompts: each task's prompt as its harness sends it (the system prompt as a message, or
  folded into the user's, as the harness does), ~1 in 8 held out by hash as any prompts
  file's; a row carries its task's index and key (a task is found by its prompt, so two
  tasks with one prompt are played as the first);
- an episode (`VerifiersAgent`, an agent `async (base_url, row) -> reward`, driven by
  `episodes` exactly as `task.agent`'s are: one endpoint session per episode, task/agents/agent.py):
  the env's `run_episode` on the row's task with its client at base_url; the
  reward is the mean over the episode's trainable traces of each one's weighted rewards
  (one trace for a single-agent env); an episode verifiers marks failed raises, so it is a
  failed episode (counted) with verifiers' error as its message.

The package is an extra (`pip install 'rlhf-async[verifiers]'`), imported only here (and
by the fork server, `PRELOAD`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import pkgutil
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf_async.config import ConfigError, TaskConfig
from rlhf_async.task.adapters.interface import Rows
from rlhf_async.task.agents import agent_episodes
from rlhf_async.task.sources.tokens import Prompt

if TYPE_CHECKING:
    from rlhf_async.task.agents.agent import AgentEpisodes

EXTRA = "pip install 'rlhf-async[verifiers]'"
MODEL = "policy"  # any name: the endpoint serves the policy whatever a request names
# the endpoint needs no key; verifiers reads one from this variable ("EMPTY" when unset)
KEY_VAR = "RLHF_ASYNC_ENDPOINT_KEY"
LOCAL_RUNTIME = {"type": "subprocess"}


class VerifiersEpisodeFailed(RuntimeError):
    """verifiers marked the episode failed (its harness, task or env raised, or timed out)."""


# what the fork server imports for a verifiers environment (seconds of CPU, which would
# otherwise stall each node's heartbeats as it loads the task); not the environment's own
# module: an error raised importing it would end the fork server, not report it
PRELOAD = ("verifiers.v1",)


def _loaders() -> Any:
    try:
        from verifiers.v1.utils import loaders
    except ImportError as e:
        if (e.name or "").split(".")[0] != "verifiers":
            raise
        raise ConfigError([f"task.env: a verifiers environment needs the verifiers "
                           f"package: {EXTRA}"]) from None
    return loaders


def installed() -> list[str]:
    """Taskset ids this Python can load: verifiers' built-in ones and the installed
    distributions that depend on verifiers (a module on the path is not listed)."""
    from verifiers.v1 import tasksets

    names = {m.name for m in pkgutil.iter_modules(tasksets.__path__)}
    for dist in importlib.metadata.distributions():
        if any(r.split(";")[0].strip().startswith("verifiers")
               for r in dist.requires or []):
            names.add(dist.metadata["Name"])
    return sorted(names)


def _failure(e: BaseException) -> str:
    """'Type: message (at file:line)' of an exception from the user's environment code."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def _env_config(name: str, conf: dict[str, Any]) -> Any:
    """verifiers' env config for taskset `name` and `task.verifiers` (less `select`), each
    role's runtime local unless given; one ConfigError for what verifiers refuses."""
    loaders = _loaders()
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import agent_config_fields

    taskset = conf.get("taskset", {})
    if not isinstance(taskset, dict) or taskset.get("id", name) != name:
        raise ConfigError([f"task.verifiers: taskset must be a table of the taskset's knobs "
                           f"(its id is task.env's, {name!r}); got {taskset!r}"])
    raw = {**conf, "taskset": {**taskset, "id": name}}
    try:
        cfg = loaders.resolve_env_config(raw)
        given = {r: raw.get(r) or {} for r in agent_config_fields(cfg)}
        local = {r: {**v, "runtime": LOCAL_RUNTIME} for r, v in given.items()
                 if isinstance(v, dict) and "runtime" not in v}
        if local:
            cfg = loaders.resolve_env_config({**raw, **local})
    except ModuleNotFoundError as e:
        raise ConfigError([f"task.env: {name!r} is not an installed verifiers environment "
                           f"({e}); installed: {', '.join(installed()) or 'none'} (an "
                           "environment is a package, or a module on the Python path, "
                           "exporting its Taskset via __all__)"]) from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                             for x in e.errors()[:5])
        raise ConfigError([f"task.verifiers: the verifiers environment {name!r} refuses "
                           f"its config: {problems}"]) from None
    except Exception as e:  # the environment's own code, or verifiers' checks of it
        raise ConfigError([f"task.env: loading the verifiers environment {name!r} "
                           f"failed: {_failure(e)}"]) from None
    return cfg


@dataclass
class Loaded:
    """One process's environment and its tasks (in the taskset's order, selected)."""

    env: Any
    tasks: list[Any]
    appends_system: bool  # the first role's harness sends the system prompt on its own
    index: dict[str, int] = field(default_factory=dict)  # task key -> position


@functools.lru_cache(maxsize=4)
def _load(name: str, conf_json: str) -> Loaded:
    conf = json.loads(conf_json)
    select = conf.pop("select", {})
    cfg = _env_config(name, conf)
    loaders = _loaders()
    from pydantic import ValidationError
    from verifiers.v1 import SelectConfig

    try:
        env = loaders.load_environment(cfg)
        taskset = env.taskset.select(SelectConfig.model_validate(select))
        if not taskset.bounded:
            raise ConfigError([f"task.verifiers: the taskset {name!r} is infinite; bound it "
                               "with select = {limit = N} (or closed include.idx ranges)"])
        tasks = list(taskset)
    except ConfigError:
        raise
    except ValidationError as e:
        raise ConfigError([f"task.verifiers: select: {e.errors()[0]['msg']} (accepted: "
                           "include, exclude, shuffle, seed, skip, limit)"]) from None
    except Exception as e:  # the environment's own code: its error, where it was raised
        raise ConfigError([f"task.env: loading the verifiers environment {name!r} "
                           f"failed: {_failure(e)}"]) from None
    if not tasks:
        raise ConfigError([f"task.env: the verifiers environment {name!r} has no tasks "
                           f"(after task.verifiers' select = {select})"])
    harness = next(iter(cfg.agent_harnesses().values()))
    appends = bool(loaders.harness_class(harness.id).APPENDS_SYSTEM_PROMPT)
    return Loaded(env, tasks, appends, {t.key: i for i, t in enumerate(tasks)})


def load(name: str, t: TaskConfig) -> Loaded:
    """The environment `name` with `task.verifiers`, loaded once per process and
    configuration."""
    problems = name_problems(name, t)
    if problems:
        raise ConfigError(problems)
    return _load(name, json.dumps(t.verifiers, sort_keys=True))


def name_problems(name: str, t: TaskConfig) -> list[str]:
    return [] if name else [f"task.env: {t.env!r} names no environment; expected "
                            f"'{t.env}<taskset id>'"]  # (t.env is the bare prefix)


def task_prompt(data: Any, appends_system: bool, chat: bool) -> Prompt:
    """A task's opening as its harness sends it (see the module)."""
    from verifiers.v1.types import content_text

    system, prompt = data.system_prompt, data.prompt
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        [{"role": m.role, "content": content_text(m.content)} for m in prompt or []]
    if not any(m["role"] == "user" and m["content"] for m in turns):
        raise ConfigError([f"task.env: verifiers task {data.idx} opens with no user "
                           "prompt; tasks whose user speaks first are not supported"])
    if system and not appends_system:  # folded into the first user turn, as resolve_prompt
        first = next(i for i, m in enumerate(turns) if m["role"] == "user")
        turns[first] = {"role": "user", "content": f"{system}\n\n{turns[first]['content']}"}
    elif system:
        turns.insert(0, {"role": "system", "content": system})
    if chat:
        return turns
    return "\n\n".join(m["content"] for m in turns)


def read_verifiers(name: str, t: TaskConfig) -> Rows:
    """Each task's prompt, its row's columns the task's index and key."""
    loaded = load(name, t)
    prompts = [task_prompt(x.data, loaded.appends_system, t.chat_template)
               for x in loaded.tasks]
    columns = [{"vf_task": i, "vf_key": x.key} for i, x in enumerate(loaded.tasks)]
    return Rows(prompts, columns)


class VerifiersAgent:
    """One episode of `task.env`'s verifiers environment per call, as an agent: `await
    agent(base_url, row) -> reward` (see the module)."""

    def __init__(self, name: str, t: TaskConfig) -> None:
        self.name = t.env
        self.loaded = load(name, t)
        self.users = 0  # episodes in flight: they share one `env.serving()`
        self.serving: contextlib.AsyncExitStack | None = None
        self.locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    def task(self, row: dict[str, Any]) -> Any:
        i = row.get("vf_task")
        tasks = self.loaded.tasks
        if isinstance(i, int) and 0 <= i < len(tasks) and tasks[i].key == row.get("vf_key"):
            return tasks[i]
        j = self.loaded.index.get(str(row.get("vf_key")))
        if j is None:
            raise VerifiersEpisodeFailed(f"{self.name}: the row names no task of the "
                                         f"environment (vf_task = {i!r})")
        return tasks[j]

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        """verifiers' serving resources (its interception server, shared tools), entered
        by the first episode in flight and left by the last: `Env.serving` keeps them on
        the env, so concurrent episodes must share one."""
        lock = self.locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            if self.users == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.loaded.env.serving())
                self.serving = stack
            self.users += 1
        try:
            yield
        finally:
            async with lock:
                self.users -= 1
                if self.users == 0 and self.serving is not None:
                    stack, self.serving = self.serving, None
                    await stack.aclose()

    async def __call__(self, base_url: str, row: dict[str, Any]) -> float:
        from verifiers.v1 import EvalClientConfig, ModelContext

        task = self.task(row)
        ctx = ModelContext(model=MODEL, client=EvalClientConfig(base_url=base_url,
                                                                api_key_var=KEY_VAR))
        async with self._serving():
            episode = await self.loaded.env.run_episode(task, ctx)
        if not episode.ok:
            errors = [*episode.errors, *(e for x in episode.traces for e in x.errors)]
            last = errors[-1] if errors else None
            raise VerifiersEpisodeFailed(
                f"{self.name}: episode failed: "
                f"{f'{last.type}: {last.message}' if last else 'no error recorded'}")
        traces = [x for x in episode.traces if x.agent is None or x.agent.trainable]
        if not traces:
            raise VerifiersEpisodeFailed(f"{self.name}: the episode has no trainable trace")
        return sum(x.reward for x in traces) / len(traces)


class VerifiersAdapter:
    """`task.env = "verifiers:<environment>"`: its tasks the prompts, its harness the
    agent, its rubric the reward (see the module)."""

    key, gives_prompts, gives_reward, preload = "env", True, True, PRELOAD

    def __init__(self, argument: str, task: TaskConfig) -> None:
        self.name, self.task = argument, task

    def problems(self) -> list[str]:
        return name_problems(self.name, self.task)  # the rest when it loads (its import)

    def check_reachable(self) -> None:
        pass  # a harness runs in a local subprocess runtime: nothing to reach before start

    def rows(self) -> Rows:
        return read_verifiers(self.name, self.task)

    def rule(self) -> None:
        return None  # the rubric's score, as the agent's reward

    def environment(self) -> None:
        return None

    def agent(self, tokenizer: Any) -> AgentEpisodes:
        """`VerifiersAgent` driven as a `task.agent` is (`AgentEpisodes`: one endpoint
        session per episode)."""
        return agent_episodes(VerifiersAgent(self.name, self.task), tokenizer)
