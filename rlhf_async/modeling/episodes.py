"""Multi-turn episodes, token in and token out, around the keyed sampler.

Each policy turn is one batched `sample` over the episodes still running, continuing from
each one's prompt and earlier turns as token ids; each environment turn appends the tokens
the task renders for its observation (a chat template's delta, tokenised once). Nothing is
ever re-tokenised, so the ids trained on are exactly the ids sampled and read. The
environment calls of a turn run concurrently on one event loop of this process (`env_calls`).

An episode is a row of one `RolloutBatch`: its response holds every turn after the prompt,
`response_mask` marking the policy's tokens POLICY and the environment's ENV, so the
learner reads the environment's tokens but trains only on the policy's. Every episode's
response is `EpisodeSpec.max_tokens` wide, so chunks concatenate (Separation).

Why contexts are padded to a fixed width (prompt + max_tokens) rather than to the batch's
longest: how much padding a row gets must not depend on which other episodes share its
batch, or a strategy that batches differently could round differently and sample another
token. The sampling noise of a turn's k-th token is the k-th uniform keyed by (seed, step,
sample id, turn), so a one-turn episode samples what `generate` samples, and a generator
that takes each turn as an engine request (`play` with its own `PolicyTurn`) samples the
same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from rlhf_async.modeling.determinism import key_seed, seeded_uniform
from rlhf_async.modeling.env_calls import (
    call,
    checked_reset,
    checked_step,
    env_loop,
    timed_out,
    warn,
)
from rlhf_async.modeling.environment import Env, EpisodeSpec
from rlhf_async.modeling.generation import (
    Between,
    SamplingParams,
    completes_stop_string,
    generate,
    request_seed,
    sample,
)
from rlhf_async.modeling.rollout import ENV, POLICY, PromptBatch, RolloutBatch

# How an episode ended (`RolloutBatch.episode_ends`, counted per step as `episodes/<how>`):
# the environment said done; max_turns policy turns were taken; truncated: a policy turn ran
# out of tokens (generation.max_new_tokens, or the episode's max_episode_tokens) before it
# ended, or an observation did not fit: there is no complete action to show the environment,
# so the episode ends there with the reward it has; timeout: a reset/step call took longer
# than task.env_timeout_s (an agent's episode: longer than task.agent_timeout_s); failed: an
# agent (`task.agent`) raised, returned no reward or never called the policy.
ENDS = ("done", "max_turns", "truncated", "timeout", "failed")


@dataclass
class Episode:
    """One row's episode as it grows."""

    prompt: list[int]  # the prompt's real tokens
    env: Env
    tokens: list[int] = field(default_factory=list)  # every token after the prompt
    kinds: list[int] = field(default_factory=list)  # POLICY | ENV per token
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob (0 on ENV)
    reward: float = 0.0
    done: bool = False
    end: str = "max_turns"  # how it ended (ENDS); max_turns until something else ends it
    segments: int = 0  # an agent's: token histories it ran (a rewritten history opens one)
    earlier: list[Episode] = field(default_factory=list)  # the ones before this, trained too
    error: str = ""  # why it failed or timed out (for the error that stops a failing run)

    def finish(self, how: str) -> None:
        self.done, self.end = True, how

    def add(self, tokens: list[int], kind: int, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.kinds += [kind] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


async def _reset_all(spec: EpisodeSpec, eps: list[Episode], rows: list[dict]) -> list[Any]:
    return list(await asyncio.gather(*(call(spec, "reset", e.env.reset(r))
                                       for e, r in zip(eps, rows, strict=True))))


async def _close_all(spec: EpisodeSpec, eps: list[Episode]) -> None:
    """Episodes are over: environments with an async `close` (a server session) release
    what they hold; a close that fails or hangs costs a warning, never the batch."""
    closes = [e.env.close() for e in eps  # type: ignore[attr-defined]  # optional method
              if callable(getattr(e.env, "close", None))]
    done = await asyncio.gather(*(asyncio.wait_for(c, spec.timeout_s) for c in closes),
                                return_exceptions=True)
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        warn("environment close failed or timed out", spec.name,
                   error=str(failed[0])[:200])


async def _step_all(spec: EpisodeSpec, eps: list[Episode], actions: list[str]) -> list[Any]:
    return list(await asyncio.gather(*(call(spec, "step", e.env.step(a))
                                       for e, a in zip(eps, actions, strict=True))))


def _observe(spec: EpisodeSpec, ep: Episode, observation: str, stops: tuple[int, ...]) -> None:
    """Append an observation's tokens, or end the episode when they do not fit."""
    delta = after_turn(ep, spec.render(observation), stops)
    if len(ep.tokens) + len(delta) >= spec.max_tokens:
        ep.finish("truncated")  # no room for the observation and a reply to it
        return
    ep.add(delta, ENV)


def after_turn(ep: Episode, delta: list[int], stops: tuple[int, ...]) -> list[int]:
    """`delta` (a template's tokens after a policy turn) as appended to `ep`: a turn that
    ended in a stop token the template also closes the turn with keeps one."""
    if delta and ep.kinds and ep.kinds[-1] == POLICY and ep.tokens[-1] in stops \
            and delta[0] == ep.tokens[-1]:
        return delta[1:]
    return delta


# One policy turn over the episodes still running: (turn index, the episodes, their sample
# ids) -> per episode (its new tokens, their log-probs, whether the turn ended in a stop
# rather than at a token limit). Token k of turn t is sampled with the k-th uniform of the
# stream keyed `request_seed(seed, step, sample id, turn=t)`, whoever samples it.
PolicyTurn = Callable[[int, list["Episode"], list[int]],
                      Awaitable[list[tuple[list[int], list[float], bool]]]]


def batch_turn(actor: nn.Module, params: SamplingParams, spec: EpisodeSpec, seed: int,
               step: int, width: int) -> PolicyTurn:
    """Policy turns as one batched `sample` over the episodes (each with room left), their
    contexts left-padded to `width`."""
    E = spec.max_tokens

    async def turn(k: int, eps: list[Episode], sids: list[int],
                   ) -> list[tuple[list[int], list[float], bool]]:
        R = min(params.max_new_tokens, max(E - len(e.tokens) for e in eps))
        ids = torch.full((len(eps), width), params.pad_id, dtype=torch.long)  # [b, W]
        mask = torch.zeros_like(ids)
        u = torch.stack([seeded_uniform(request_seed(seed, step, sid, turn=k),
                                        (params.max_new_tokens,))[:R] for sid in sids])
        for i, e in enumerate(eps):
            ctx = e.prompt + e.tokens
            ids[i, width - len(ctx):], mask[i, width - len(ctx):] = torch.tensor(ctx), 1
        device = next(actor.parameters()).device
        # R, not max_new_tokens: when every episode of the turn has less room (an agent's
        # calls come in small batches) there are only R uniforms
        g = sample(actor, ids.to(device), mask.to(device), replace(params, max_new_tokens=R),
                   u)
        out = []
        for i, e in enumerate(eps):
            made, room = int((g.response_mask[i] > 0).sum()), E - len(e.tokens)
            n = min(made, room)
            toks = g.response_ids[i, :n].tolist()
            out.append((toks, g.logprobs[i, :n].tolist(),
                        made <= room and _ended(params, toks, R)))
        return out
    return turn


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
    """One episode per row of `prompts`, each policy turn one batched `sample`."""
    width = prompts.prompt_ids.shape[1] + spec.max_tokens  # fixed: see the docstring
    turn = batch_turn(actor, params, spec, seed, step, width)
    eps = env_loop().run(play(prompts, params, spec, seed, step, turn))
    return episode_batch(prompts, eps, spec.max_tokens, params.pad_id, version, step)


def episode_rows(prompts: PromptBatch, spec: EpisodeSpec, seed: int, step: int,
                 ) -> list[tuple[int, list[int], dict[str, Any]]]:
    """(sample id, prompt tokens, the row its episode opens with) per row of `prompts`;
    the row's "seed" keyed by (seed, step, sample id)."""
    out = []
    for p, m, sid in zip(prompts.prompt_ids.tolist(), prompts.prompt_mask.tolist(),
                         prompts.sample_ids.tolist(), strict=True):
        prompt = [t for t, k in zip(p, m, strict=True) if k]
        out.append((int(sid), prompt,
                    {**spec.row(prompt), "seed": key_seed(seed, "env", step, int(sid))}))
    return out


async def play(prompts: PromptBatch, params: SamplingParams, spec: EpisodeSpec, seed: int,
               step: int, turn: PolicyTurn) -> list[Episode]:
    """One episode per row of `prompts`, its policy turns taken by `turn`; its environment
    seeded by (seed, step, sample id). A spec with a `driver` (an agent's episodes,
    `task/agents/agent.py`) runs them its own way over the same `turn`."""
    if spec.driver is not None:
        return list(await spec.driver(prompts, params, spec, seed, step, turn))
    ids = [int(s) for s in prompts.sample_ids]
    eps, rows = [], []
    for _, prompt, row in episode_rows(prompts, spec, seed, step):
        eps.append(Episode(prompt, spec.make_env()))
        rows.append(row)
    for e, (ok, obs) in zip(eps, await _reset_all(spec, eps, rows), strict=True):
        if not ok:
            e.finish("timeout")
            e.error = timed_out(spec, "reset")
        elif first := checked_reset(spec, obs):
            _observe(spec, e, first, params.stops)
    for k in range(spec.max_turns):
        for e in eps:
            if not e.done and len(e.tokens) >= spec.max_tokens:
                e.finish("truncated")
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        turns = await turn(k, [eps[i] for i in live], [ids[i] for i in live])
        acting: list[int] = []
        for i, (toks, lps, ended) in zip(live, turns, strict=True):
            eps[i].add(toks, POLICY, lps)
            if ended:
                acting.append(i)
            else:  # out of tokens mid-turn: no complete action to take
                eps[i].finish("truncated")
        actions = [spec.decode(turns[live.index(i)][0]) for i in acting]
        results = await _step_all(spec, [eps[i] for i in acting], actions)
        for i, (ok, out) in zip(acting, results, strict=True):
            if not ok:
                eps[i].finish("timeout")
                eps[i].error = timed_out(spec, "step")
                continue
            obs, reward, done = checked_step(spec, out)
            eps[i].reward += reward
            if done:
                eps[i].finish("done")
            else:
                _observe(spec, eps[i], obs, params.stops)
    await _close_all(spec, eps)
    return eps


def episode_batch(prompts: PromptBatch, eps: list[Episode], width: int, pad_id: int, version: int,
           step: int) -> RolloutBatch:
    """The episodes' rollout: each response `width` wide, `response_mask` POLICY / ENV; a
    row's prompt its episode's (an agent's may render its own, at most the batch's width).
    An agent's earlier segments follow the episodes as rows of their own: the episode's
    sample id, group, reward and end, `episode_segments` 0 (trained, not counted)."""
    rows = [*enumerate(eps), *((i, s) for i, e in enumerate(eps) for s in e.earlier)]
    src = torch.tensor([i for i, _ in rows], dtype=torch.long)
    B, P = len(rows), prompts.prompt_ids.shape[1]
    ids, pmask = prompts.prompt_ids.cpu()[src], prompts.prompt_mask.cpu()[src]
    resp = torch.full((B, width), pad_id, dtype=torch.long)
    kinds = torch.zeros((B, width), dtype=torch.long)
    lps = torch.zeros((B, width), dtype=torch.float32)
    for r, (_, e) in enumerate(rows):
        n = len(e.tokens)
        resp[r, :n], kinds[r, :n] = torch.tensor(e.tokens, dtype=torch.long), \
            torch.tensor(e.kinds, dtype=torch.long)
        lps[r, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
        if e.prompt != ids[r][pmask[r].bool()].tolist():
            ids[r], pmask[r] = pad_id, 0
            ids[r, P - len(e.prompt):], pmask[r, P - len(e.prompt):] = torch.tensor(e.prompt), 1
    device, of = prompts.prompt_ids.device, [eps[i] for i, _ in rows]
    segments = torch.tensor([e.segments if r < len(eps) else 0 for r, e in enumerate(of)],
                            dtype=torch.long).to(device) if all(e.segments for e in eps) else None
    return RolloutBatch(ids.to(device), pmask.to(device), resp.to(device),
                        kinds.to(device), lps.to(device),
                        prompts.sample_ids[src.to(prompts.sample_ids.device)],
                        prompts.group_ids[src.to(prompts.group_ids.device)],
                        version=version, step=step,
                        env_rewards=torch.tensor([e.reward for e in of]).to(device),
                        episode_ends=torch.tensor([ENDS.index(e.end) for e in of],
                                                  dtype=torch.long).to(device),
                        episode_segments=segments,
                        episode_error=next((e.error for e in eps if e.error), ""))


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
