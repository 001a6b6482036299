"""Multi-turn episodes, token in and token out, around the keyed sampler.

Each policy turn is one batched `sample` over the episodes still running, continuing from
each one's prompt and earlier turns as token ids; each environment turn appends the tokens
the task renders for its observation (a chat template's delta, tokenised once). Nothing is
ever re-tokenised, so the ids trained on are exactly the ids sampled and read. The
environment calls of a turn run concurrently on one event loop of this process.

An episode is a row of one `RolloutBatch`: its response holds every turn after the prompt,
`response_mask` marking the policy's tokens POLICY and the environment's ENV, so the
learner reads the environment's tokens but trains only on the policy's. Every episode's
response is `EpisodeSpec.max_tokens` wide, so chunks concatenate (Separation).

Why contexts are padded to a fixed width (prompt + max_tokens) rather than to the batch's
longest: how much padding a row gets must not depend on which other episodes share its
batch, or a strategy that batches differently could round differently and sample another
token. The sampling noise of an episode's k-th token is the k-th uniform keyed by (seed,
step, sample id), so a one-turn episode samples what `generate` samples.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from rlhf_async.log import get_logger
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.environment import Env, EpisodeSpec
from rlhf_async.modeling.generation import (
    Between,
    SamplingParams,
    completes_stop_string,
    generate,
    sample,
    sampling_uniforms,
)
from rlhf_async.modeling.rollout import (
    END_DONE,
    END_MAX_TURNS,
    END_TIMEOUT,
    END_TRUNCATED,
    ENV,
    POLICY,
    PromptBatch,
    RolloutBatch,
)

log = get_logger(component="episodes")
T = TypeVar("T")


class EnvError(RuntimeError):
    """An environment's reset or step raised, or answered something that is not
    (str, float, bool): the user's environment is wrong, and a rerun would repeat it, so
    the run stops with this (never retried as a node death)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"task.env: {message}")


def where_raised(e: BaseException) -> str:
    """'file.py:LINE' of the innermost frame `e` went through (the user's code, for an
    exception raised there), or '' without a traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


class _EnvLoop:
    """One event loop on a daemon thread for every environment call of this process: the
    callers are synchronous (a rank's loop, a generator's worker thread) and may run inside
    another loop, where `asyncio.run` is not allowed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="env-loop", daemon=True).start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(_as_coro(coro), self.loop).result()


async def _as_coro(aw: Awaitable[T]) -> T:
    return await aw


_LOOP: list[_EnvLoop] = []
_LOOP_LOCK = threading.Lock()


def env_loop() -> _EnvLoop:
    with _LOOP_LOCK:
        if not _LOOP:
            _LOOP.append(_EnvLoop())
        return _LOOP[0]


@dataclass
class _Episode:
    """One row's episode as it grows."""

    prompt: list[int]  # the prompt's real tokens
    env: Env
    end: int = END_MAX_TURNS  # how it ended (END_*), until told otherwise
    tokens: list[int] = field(default_factory=list)  # every token after the prompt
    kinds: list[int] = field(default_factory=list)  # POLICY | ENV per token
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob (0 on ENV)
    reward: float = 0.0
    done: bool = False

    def stop(self, end: int) -> None:
        self.done, self.end = True, end

    def add(self, tokens: list[int], kind: int, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.kinds += [kind] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


async def _call(spec: EpisodeSpec, what: str, aw: Awaitable[Any]) -> tuple[bool, Any]:
    """(finished in time, its value). Past `spec.timeout_s` the call is abandoned (its
    episode ends, counted: one warning per batch, not one per call); an exception is the
    environment's bug and stops the run, named with where it was raised."""
    try:
        return True, await asyncio.wait_for(aw, spec.timeout_s)
    except TimeoutError:
        return False, None
    except Exception as e:  # whatever the user's environment raises
        at = where_raised(e)
        raise EnvError(f"{spec.name!r}: {what}() raised {type(e).__name__}: {e}"
                       + (f" (at {at})" if at else "")) from e


def _checked_reset(spec: EpisodeSpec, out: Any) -> str:
    if not isinstance(out, str):
        raise EnvError(f"{spec.name!r}: reset() must return the first observation (str, "
                       f"'' for none), got {type(out).__name__} {str(out)[:120]!r}")
    return out


def _checked_step(spec: EpisodeSpec, out: Any) -> tuple[str, float, bool]:
    ok = (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str)
          and isinstance(out[1], int | float) and not isinstance(out[1], bool))
    if not ok:
        raise EnvError(f"{spec.name!r}: step() must return (observation: "
                       f"str, reward: float, done: bool), got {str(out)[:120]!r}")
    return out[0], float(out[1]), bool(out[2])


def _timed_out(spec: EpisodeSpec, what: str, eps: list[_Episode],
               results: list[tuple[bool, Any]]) -> None:
    """End the episodes whose call timed out, with one warning for all of them."""
    late = [e for e, (ok, _) in zip(eps, results, strict=True) if not ok]
    for e in late:
        e.stop(END_TIMEOUT)
    if late:
        log.warning("environment calls timed out; their episodes end", env=spec.name,
                    call=what, count=len(late), of=len(eps), timeout_s=spec.timeout_s)


async def _reset_all(spec: EpisodeSpec, eps: list[_Episode], rows: list[dict]) -> list[Any]:
    return list(await asyncio.gather(*(_call(spec, "reset", e.env.reset(r))
                                       for e, r in zip(eps, rows, strict=True))))


async def _step_all(spec: EpisodeSpec, eps: list[_Episode], actions: list[str]) -> list[Any]:
    return list(await asyncio.gather(*(_call(spec, "step", e.env.step(a))
                                       for e, a in zip(eps, actions, strict=True))))


async def _close_all(spec: EpisodeSpec, eps: list[_Episode]) -> None:
    """Episodes are over: environments with an async `close` (a server session) release
    what they hold; a close that fails or hangs costs nothing but a warning."""
    closes = [getattr(e.env, "close")() for e in eps  # noqa: B009  (not in the Protocol)
              if callable(getattr(e.env, "close", None))]
    done = await asyncio.gather(*(_call(spec, "close", c) for c in closes),
                                return_exceptions=True)
    failed = [d for d in done if isinstance(d, BaseException) or not d[0]]
    if failed:
        log.warning("environment close failed or timed out", env=spec.name,
                    count=len(failed), error=str(failed[0])[:200])


def _observe(spec: EpisodeSpec, ep: _Episode, observation: str, stops: tuple[int, ...]) -> None:
    """Append an observation's tokens, or end the episode when they do not fit."""
    delta = spec.render(observation)
    # a turn that ended in a stop token the template also closes the turn with keeps one
    if delta and ep.kinds and ep.kinds[-1] == POLICY and ep.tokens[-1] in stops \
            and delta[0] == ep.tokens[-1]:
        delta = delta[1:]
    if len(ep.tokens) + len(delta) >= spec.max_tokens:
        ep.stop(END_TRUNCATED)
        return
    ep.add(delta, ENV)


def _policy_turn(actor: nn.Module, params: SamplingParams, spec: EpisodeSpec,
                 eps: list[_Episode], uniforms: torch.Tensor, width: int,
                 ) -> list[tuple[list[int], list[float], bool]]:
    """One batched `sample` over `eps` (each with room left), their contexts left-padded to
    `width`: per episode (its new tokens, their log-probs, whether the turn ended in a stop
    rather than at a token limit)."""
    E = spec.max_tokens
    R = min(params.max_new_tokens, max(E - len(e.tokens) for e in eps))
    ids = torch.full((len(eps), width), params.pad_id, dtype=torch.long)  # [b, W]
    mask = torch.zeros_like(ids)
    u = torch.full((len(eps), R), 0.5, dtype=torch.float64)  # [b, R]
    for i, e in enumerate(eps):
        ctx = e.prompt + e.tokens
        ids[i, width - len(ctx):], mask[i, width - len(ctx):] = torch.tensor(ctx), 1
        n = min(R, E - len(e.tokens))
        u[i, :n] = uniforms[i, len(e.tokens): len(e.tokens) + n]
    device = next(actor.parameters()).device
    g = sample(actor, ids.to(device), mask.to(device), params, u)
    out = []
    for i, e in enumerate(eps):
        made, room = int((g.response_mask[i] > 0).sum()), E - len(e.tokens)
        n = min(made, room)
        toks = g.response_ids[i, :n].tolist()
        out.append((toks, g.logprobs[i, :n].tolist(), made <= room and _ended(params, toks, R)))
    return out


def _ended(params: SamplingParams, toks: list[int], limit: int) -> bool:
    """Whether `sample` ended this turn at a stop (not at its `limit` of tokens)."""
    if not toks:
        return False
    if len(toks) < limit or toks[-1] in params.stops:
        return True
    return bool(params.stop_strings) and params.decode is not None and \
        completes_stop_string(toks, params.stop_strings, params.decode)


def run_episodes(actor: nn.Module, prompts: PromptBatch, params: SamplingParams,
                 spec: EpisodeSpec, seed: int, step: int, version: int) -> RolloutBatch:
    """One episode per row of `prompts`; its environment seeded by (seed, step, sample id)."""
    ids = [int(s) for s in prompts.sample_ids]
    uniforms = sampling_uniforms(seed, step, ids, spec.max_tokens)  # [B, E]
    width = prompts.prompt_ids.shape[1] + spec.max_tokens  # fixed: see the docstring
    eps, rows = [], []
    for p, m, sid in zip(prompts.prompt_ids.tolist(), prompts.prompt_mask.tolist(), ids,
                         strict=True):
        prompt = [t for t, k in zip(p, m, strict=True) if k]
        eps.append(_Episode(prompt, spec.make_env()))
        rows.append({**spec.row(prompt), "seed": key_seed(seed, "env", step, sid)})
    loop = env_loop()
    results = loop.run(_reset_all(spec, eps, rows))
    _timed_out(spec, "reset", eps, results)
    for e, (ok, obs) in zip(eps, results, strict=True):
        if ok and _checked_reset(spec, obs):
            _observe(spec, e, obs, params.stops)
    for _ in range(spec.max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        _turn(actor, params, spec, eps, live, uniforms, width)
    loop.run(_close_all(spec, eps))
    return _batch(prompts, eps, spec.max_tokens, params.pad_id, version, step)


def _turn(actor: nn.Module, params: SamplingParams, spec: EpisodeSpec, eps: list[_Episode],
          live: list[int], uniforms: torch.Tensor, width: int) -> None:
    """One policy turn of the `live` episodes, then their environments' steps. A turn cut
    at a token limit (generation.max_new_tokens, or the episode's max_tokens) is no action:
    its episode ends truncated without a step, keeping the rewards of its earlier steps."""
    turns = _policy_turn(actor, params, spec, [eps[i] for i in live], uniforms[live], width)
    acting: list[int] = []
    for i, (toks, lps, ended) in zip(live, turns, strict=True):
        eps[i].add(toks, POLICY, lps)
        if ended:
            acting.append(i)
        else:
            eps[i].stop(END_TRUNCATED)
    actions = [spec.decode(turns[live.index(i)][0]) for i in acting]
    results = env_loop().run(_step_all(spec, [eps[i] for i in acting], actions))
    _timed_out(spec, "step", [eps[i] for i in acting], results)
    for i, (ok, out) in zip(acting, results, strict=True):
        if not ok:
            continue
        obs, reward, done = _checked_step(spec, out)
        eps[i].reward += reward
        if done:
            eps[i].stop(END_DONE)
        else:
            _observe(spec, eps[i], obs, params.stops)


def _batch(prompts: PromptBatch, eps: list[_Episode], width: int, pad_id: int, version: int,
           step: int) -> RolloutBatch:
    B = len(eps)
    resp = torch.full((B, width), pad_id, dtype=torch.long)
    kinds = torch.zeros((B, width), dtype=torch.long)
    lps = torch.zeros((B, width), dtype=torch.float32)
    for i, e in enumerate(eps):
        n = len(e.tokens)
        resp[i, :n], kinds[i, :n] = torch.tensor(e.tokens, dtype=torch.long), \
            torch.tensor(e.kinds, dtype=torch.long)
        lps[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    device = prompts.prompt_ids.device
    return RolloutBatch(prompts.prompt_ids, prompts.prompt_mask, resp.to(device),
                        kinds.to(device), lps.to(device), prompts.sample_ids, prompts.group_ids,
                        version=version, step=step,
                        env_rewards=torch.tensor([e.reward for e in eps]).to(device),
                        episode_ends=torch.tensor([e.end for e in eps]).to(device))


def rollout(actor: nn.Module, prompts: PromptBatch, params: SamplingParams, seed: int,
            step: int, version: int, between: Between | None = None) -> RolloutBatch:
    """What every strategy calls to roll out a batch: one response per row, or with
    `params.episode` one multi-turn episode per row. `between`: partial rollouts (weights
    swapped between decode steps, `generation.sample`), single-turn only."""
    if params.episode is None:
        return generate(actor, prompts, params, seed, step, version, between)
    if between is not None:
        raise ValueError("partial rollouts (weights swapped mid-generation) are not "
                         "supported with multi-turn episodes")
    return run_episodes(actor, prompts, params, params.episode, seed, step, version)
