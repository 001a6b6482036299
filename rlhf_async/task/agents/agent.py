"""An agent's episodes (`task.agent = "file.py:run"`): the user's `async run(base_url, row)`
talks to the policy through any OpenAI-compatible client and returns the episode's reward
(a number, or a dict with "reward").

Each row of a batch is one episode and one session of the endpoint (`endpoint.py`,
`agent_session.py`): what the policy generated there, with what the agent added, is the
row's response, exactly as an environment's episode is (`EpisodeSpec.driver`, so every
strategy runs agents where it runs environments: `modeling.episodes.play`). The agents run
on their own event loop thread: one that blocks (a synchronous client) delays the other
agents, never the endpoint that answers it.

An agent that raises, returns no reward, or never calls the endpoint fails its episode
(`episodes/failed`); one past `task.agent_timeout_s` is cancelled (`episodes/timeout`). The
run goes on: the row trains on nothing (reward 0, no tokens), and the first failure of each
kind is logged with its type, message and file:line, then counts.

Policy calls are batched: the calls waiting are sent as one policy turn per call index
once every running agent waits on one, no call came for `BATCH_WAIT_S`, or `BATCH_MAX_S`
after the oldest (an agent busy with a tool delays the others by that at most).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError
from rlhf_async.modeling.env_calls import warn, where
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.episodes import Episode, PolicyTurn, episode_rows
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import POLICY, PromptBatch
from rlhf_async.task.agents.agent_session import NO_ENV, Session
from rlhf_async.task.agents.endpoint import endpoint
from rlhf_async.task.agents.environment import load_named

Agent = Callable[[str, dict[str, Any]], Awaitable[Any]]
BATCH_WAIT_S, BATCH_MAX_S = 0.005, 0.05


class AgentFailed(Exception):
    """Why an agent's episode failed (its message is what the log shows)."""


def load_agent(spec: str) -> Agent:
    """The agent function `spec` names; one ConfigError naming what is wrong."""
    if ":" not in spec:
        raise ConfigError([f"task.agent: {spec!r}: expected 'file.py:function' or "
                           "'module.path:function'"])
    fn = load_named(spec, "task.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError([f"task.agent: {spec!r} must be an async function run(base_url, "
                           "row) -> reward (a number, or a dict with 'reward'); it is not "
                           "a coroutine function"])
    return fn


_LOOP: list[asyncio.AbstractEventLoop] = []
_LOCK = threading.Lock()


def agent_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for agents, on a daemon thread."""
    with _LOCK:
        if not _LOOP:
            _LOOP.append(asyncio.new_event_loop())
            threading.Thread(target=_LOOP[0].run_forever, name="agent-loop",
                             daemon=True).start()
        return _LOOP[0]


class _Batcher:
    """Policy calls of concurrent sessions gathered into policy turns (see the module)."""

    def __init__(self, turn: PolicyTurn, live: Callable[[], int]) -> None:
        self.turn, self.live = turn, live
        self.pending: list[tuple[int, Episode, int, asyncio.Future[Any]]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.since = 0.0  # when the oldest waiting call came
        self.error: Exception | None = None  # a generation that failed (the run stops)
        self.running: set[asyncio.Future[None]] = set()  # held: the loop keeps weak refs

    async def call(self, k: int, ep: Episode, sid: int) -> tuple[list[int], list[float], bool]:
        fut = asyncio.get_running_loop().create_future()
        if not self.pending:
            self.since = asyncio.get_running_loop().time()
        self.pending.append((k, ep, sid, fut))
        self.poke()
        return await fut  # type: ignore[no-any-return]  # set by _run

    def poke(self) -> None:
        """Flush when every running agent waits, when no call came for BATCH_WAIT_S, or
        BATCH_MAX_S after the first call waiting."""
        if not self.pending:
            return
        loop = asyncio.get_running_loop()
        if len(self.pending) >= self.live() or loop.time() - self.since >= BATCH_MAX_S:
            self.flush()
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_later(BATCH_WAIT_S, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        calls, self.pending = self.pending, []
        for k in sorted({c[0] for c in calls}):
            t = asyncio.ensure_future(self._run(k, [c for c in calls if c[0] == k]))
            self.running.add(t)
            t.add_done_callback(self.running.discard)

    async def _run(self, k: int, calls: list[tuple[int, Episode, int, asyncio.Future[Any]]],
                   ) -> None:
        try:
            outs = await self.turn(k, [c[1] for c in calls], [c[2] for c in calls])
        except Exception as e:  # the generation failed: every caller's request does
            self.error = self.error or e
            for c in calls:
                if not c[3].done():  # a caller gone (its agent cancelled) no longer waits
                    c[3].set_exception(e)
            return
        for c, out in zip(calls, outs, strict=True):
            if not c[3].done():
                c[3].set_result(out)


def _reward(out: Any) -> float:
    value = out.get("reward") if isinstance(out, dict) else out
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise AgentFailed(f"returned {str(out)[:80]!r}; expected a reward (a number) or a dict "
                      "with 'reward'")


@dataclass(frozen=True)
class AgentEpisodes:
    """`EpisodeSpec.driver` for `task.agent` (see the module)."""

    agent: Agent
    tok: PreTrainedTokenizerBase
    chat: bool  # the tokenizer has a chat template (else /chat/completions is refused)

    async def __call__(self, prompts: PromptBatch, params: SamplingParams, spec: EpisodeSpec,
                       seed: int, step: int, turn: PolicyTurn) -> list[Episode]:
        server = await endpoint()
        running = [len(prompts)]
        batcher = _Batcher(turn, lambda: running[0])
        rows = episode_rows(prompts, spec, seed, step)
        sessions = []
        for sid, _, _ in rows:
            def policy(k: int, ep: Episode, sid: int = sid,
                       ) -> Awaitable[tuple[list[int], list[float], bool]]:
                return batcher.call(k, ep, sid)
            sessions.append(Session(self.tok, policy, spec.decode, params,
                                    prompts.prompt_ids.shape[1], spec.max_tokens,
                                    spec.max_turns, self.chat, name=spec.name))

        async def one(session: Session, sid: int, prompt: list[int], row: dict[str, Any],
                      ) -> Episode:
            key, url = server.open(session, f"{step}.{sid}")
            try:
                ep = await self._episode(session, url, row, spec)
                return ep if ep.end not in ("timeout", "failed") else \
                    Episode(prompt, NO_ENV, done=True, end=ep.end, segments=ep.segments,
                            error=ep.error)
            finally:
                server.close(key)
                running[0] -= 1
                batcher.poke()  # the agents left may all be waiting now
        eps = list(await asyncio.gather(*(one(s, *r) for s, r
                                          in zip(sessions, rows, strict=True))))
        if batcher.error is not None:  # not the agents' fault: never counted as theirs
            raise batcher.error
        return eps

    async def _episode(self, session: Session, url: str, row: dict[str, Any],
                       spec: EpisodeSpec) -> Episode:
        """Run the agent to its reward; the session's last segment is the episode, its
        earlier ones `earlier` (a failed one is replaced by an empty one over the row's
        prompt)."""
        done = asyncio.run_coroutine_threadsafe(_call(self.agent, url, row), agent_loop())
        end, reward, error = "done", 0.0, ""
        try:
            reward = _reward(await asyncio.wait_for(asyncio.wrap_future(done),
                                                    spec.timeout_s))
            if not session.segments:
                raise AgentFailed("returned without calling the policy (no request to "
                                  f"{url})")
            end = "truncated" if session.truncated else "done"
        except TimeoutError:
            done.cancel()
            end, error = "timeout", (f"run() did not return within task.agent_timeout_s = "
                                     f"{spec.timeout_s:g} s")
            warn("agent episode timed out; it counts as failed", spec.name,
                 timeout_s=spec.timeout_s)
        except AgentFailed as e:
            end, error = "failed", f"run() {e}"
            warn("agent episode failed without raising", spec.name, error=str(e))
        except Exception as e:  # whatever the user's agent raises
            end, error = "failed", f"run() raised {type(e).__name__}: {e}{self._where(e)}"
            warn("agent episode failed", spec.name, error=error)
        ep = session.segments[-1].episode if session.segments else Episode([], NO_ENV)
        ep.error = f"task.agent {spec.name}: {error}" if error else ""
        ep.reward, ep.segments = reward, max(1, len(session.segments))
        # an agent that rewrote its history: each earlier segment with a policy turn is
        # trained too, as a row of its own (`episode_batch`)
        ep.earlier = [s.episode for s in session.segments[:-1] if POLICY in s.episode.kinds]
        ep.finish(end)
        return ep


    def _where(self, e: BaseException) -> str:
        """' (at file.py:LINE)': the innermost frame in the agent's own file (an error the
        client raised is reported where the agent called it; a decorated agent's own file,
        not its decorator's), else the innermost."""
        mine = getattr(getattr(inspect.unwrap(self.agent), "__code__", None), "co_filename",
                       None)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == mine]
        return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else where(e)


async def _call(agent: Agent, url: str, row: dict[str, Any]) -> Any:
    return await agent(url, row)
