"""Rollouts over a request-level generation engine (`interface.py`), written once: a
prompt batch becomes one keyed request per row (`chunk_requests`), the completions its
`RolloutBatch` (`assemble`); a multi-turn episode's policy turn is one request per episode
over the conversation so far (`turn_request`). The generator node schedules these over its
engine (continuous batching, in-flight updates: `nodes/generator/scheduler.py`); a
colocated lock-step rank runs them one batch at a time (`engine_rollout`).

Each row's request is keyed by `request_seed(run seed, step, sample id, segment/turn)`,
so its tokens do not depend on which rows share the engine's batch. What prefilling each
row's prompts cost (its requests' `Prefill`, summed) goes into the rollout as
`prefill_counts`, counted per step as `kv/*`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from rlhf_async.engines.interface import Completion, GenerationEngine, Prefill, Request
from rlhf_async.modeling.episodes import Episode, episode_batch, play
from rlhf_async.modeling.generation import Generated, SamplingParams, request_seed, rollout_batch
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch


def chunk_requests(prompts: PromptBatch, params: SamplingParams, seed: int, step: int,
                   tag: str, salt: str) -> list[tuple[int, Request]]:
    """(sample id, its request) for each row of `prompts`; request ids `tag`/sample id."""
    out = []
    for ids, mask, sid in zip(prompts.prompt_ids.tolist(), prompts.prompt_mask.tolist(),
                              prompts.sample_ids.tolist(), strict=True):
        prompt = tuple(t for t, m in zip(ids, mask, strict=True) if m)
        out.append((int(sid), Request(f"{tag}/{sid}", prompt, params.max_new_tokens,
                                      request_seed(seed, step, int(sid)),
                                      params.min_new_tokens, params.stop_ids,
                                      params.stop_strings, salt)))
    return out


def assemble(prompts: PromptBatch, done: list[Completion], params: SamplingParams, step: int,
             version: int, partial: bool) -> RolloutBatch:
    """The chunk's rollout from its rows' completions (in row order): responses [B, R]
    right-padded, behaviour log-probs (0 on padding), and with `partial` the per-token
    versions (-1 on padding; the rollout's version its oldest token's)."""
    B, R = len(done), params.max_new_tokens
    g = Generated(torch.full((B, R), params.pad_id, dtype=torch.long),
                  torch.zeros((B, R), dtype=torch.long), torch.zeros((B, R), dtype=torch.float32),
                  torch.full((B, R), -1, dtype=torch.long))
    for i, c in enumerate(done):
        n = len(c.token_ids)
        if n > R or len(c.logprobs) != n or len(c.versions) != n:
            raise RuntimeError(f"request {c.request_id}: {n} tokens, {len(c.logprobs)} "
                               f"log-probs, {len(c.versions)} versions (at most {R} each)")
        g.response_ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        g.response_mask[i, :n] = 1
        g.logprobs[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        g.token_versions[i, :n] = torch.tensor(c.versions, dtype=torch.long)
    dev = prompts.prompt_ids.device
    g = Generated(*(t.to(dev) for t in (g.response_ids, g.response_mask, g.logprobs,
                                        g.token_versions)))
    counts = prefill_counts([c.prefill for c in done]).to(dev)
    return rollout_batch(prompts, g, step, version, partial).replace(prefill_counts=counts)


def prefill_counts(prefills: Sequence[Prefill]) -> Tensor:
    """[B, 4] long: each row's `Prefill` as `RolloutBatch.prefill_counts`."""
    return torch.tensor([dataclasses.astuple(p) for p in prefills],
                        dtype=torch.long).reshape(len(prefills), -1)


class PrefillTally:
    """Each episode's prefill over its turns' requests, by sample id."""

    def __init__(self) -> None:
        self.rows: defaultdict[int, Prefill] = defaultdict(Prefill)

    def add(self, sids: Sequence[int], done: Sequence[Completion]) -> None:
        for sid, c in zip(sids, done, strict=True):
            self.rows[sid] += c.prefill

    def onto(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` with its rows' counts (rows by sample id)."""
        counts = prefill_counts([self.rows[s] for s in batch.sample_ids.tolist()])
        return batch.replace(prefill_counts=counts.to(batch.sample_ids.device))


def turn_request(tag: str, turn: int, ep: Episode, sid: int, params: SamplingParams,
                 max_tokens: int, seed: int, step: int, salt: str) -> Request:
    """Policy turn `turn` of episode `ep` (sample `sid`): its prompt the episode so far, at
    most what the episode has room for (`max_tokens` after its prompt)."""
    p = params
    return Request(f"{tag}/{sid}/{turn}", tuple(ep.prompt + ep.tokens),
                   min(p.max_new_tokens, max_tokens - len(ep.tokens)),
                   request_seed(seed, step, sid, turn=turn), p.min_new_tokens, p.stop_ids,
                   p.stop_strings, salt)


async def engine_rollout(engine: GenerationEngine, prompts: PromptBatch,
                         params: SamplingParams, seed: int, step: int) -> RolloutBatch:
    """The rollout of `prompts` on `engine` as it is now (no update lands during it): one
    response per row, or with `params.episode` one multi-turn episode per row (the
    environment's calls on this loop). Stamped with the engine's weight version."""
    version, tag = engine.version, f"{step}"
    salt = f"colocated:{version}"  # prefix-cache KV only from these weights
    if params.episode is None:
        reqs = chunk_requests(prompts, params, seed, step, tag, salt)
        done = await asyncio.gather(*(engine.generate(r) for _, r in reqs))
        return assemble(prompts, list(done), params, step, version, partial=False)
    spec, tally = params.episode, PrefillTally()

    async def turn(k: int, eps: list[Episode], sids: list[int],
                   ) -> list[tuple[list[int], list[float], bool]]:
        done = await asyncio.gather(*(
            engine.generate(turn_request(tag, k, e, sid, params, spec.max_tokens, seed, step,
                                         salt))
            for e, sid in zip(eps, sids, strict=True)))
        tally.add(sids, done)
        return [(c.token_ids, c.logprobs, c.finish == "stop") for c in done]
    eps = await play(prompts, params, spec, seed, step, turn)
    return tally.onto(episode_batch(prompts, eps, spec.max_tokens, params.pad_id, version,
                                    step))
