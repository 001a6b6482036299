"""Rollouts over a request-level generation engine (`interface.py`), written once. Every
request of a rollout is built here, by one `Requests` value per chunk (or lock-step batch):
a prompt batch becomes one keyed request per row (`rows`), a multi-turn episode's policy
turn one request per episode over the conversation so far (`turn`, run for every episode
by `episode_turns`), and a request the weights' commit aborted becomes the rest of it
(`rest`). The completions become the batch's `RolloutBatch` (`assemble`). The generator
node schedules these over its engine (continuous batching, in-flight updates:
`nodes/generator/scheduler.py`); a colocated lock-step rank runs them one batch at a time
(`engine_rollout`).

Each row's request is keyed by `request_seed(run seed, step, sample id, segment, turn)`,
so its tokens do not depend on which rows share the engine's batch; its prefix-cache salt
names the weights (version and lineage) so no KV of other weights is reused. What
prefilling each row's prompts cost (its requests' `Prefill`, summed) goes into the rollout
as `prefill_counts`, counted per step as `kv/*`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_async.engines.interface import Completion, GenerationEngine, Prefill, Request
from rlhf_async.modeling.episodes import Episode, episode_batch, play
from rlhf_async.modeling.generation import Generated, SamplingParams, request_seed, rollout_batch
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch


@dataclass(frozen=True)
class Requests:
    """How every request of one chunk (or lock-step batch) is built: ids under `tag`, keyed
    by (`seed`, `step`, sample id, segment, turn), salted by the weights that serve them
    (`version` of trainer `lineage`)."""

    params: SamplingParams
    seed: int
    step: int
    tag: str
    version: int
    lineage: str

    @property
    def salt(self) -> str:
        return f"{self.lineage}:{self.version}"

    def rows(self, prompts: PromptBatch) -> list[tuple[int, Request]]:
        """(sample id, its request) for each row of `prompts`; request ids `tag`/sample id."""
        out, p = [], self.params
        for ids, mask, sid in zip(prompts.prompt_ids.tolist(), prompts.prompt_mask.tolist(),
                                  prompts.sample_ids.tolist(), strict=True):
            prompt = tuple(t for t, m in zip(ids, mask, strict=True) if m)
            out.append((int(sid), Request(f"{self.tag}/{sid}", prompt, p.max_new_tokens,
                                          request_seed(self.seed, self.step, int(sid)),
                                          p.min_new_tokens, p.stop_ids, p.stop_strings,
                                          self.salt)))
        return out

    def turn(self, k: int, ep: Episode, sid: int, max_tokens: int) -> Request:
        """Policy turn `k` of episode `ep` (sample `sid`): its prompt the episode so far, at
        most what the episode has room for (`max_tokens` after its prompt)."""
        p = self.params
        return Request(f"{self.tag}/{sid}/{k}", tuple(ep.prompt + ep.tokens),
                       min(p.max_new_tokens, max_tokens - len(ep.tokens)),
                       request_seed(self.seed, self.step, sid, turn=k), p.min_new_tokens,
                       p.stop_ids, p.stop_strings, self.salt)

    def rest(self, first: Request, sid: int, turn: int, segment: int,
             so_far: Completion) -> Request:
        """What is left of `first` (sample `sid`'s request of policy turn `turn`) after an
        abort, as segment `segment`: what it generated appended to its prompt, for the
        tokens it has left, keyed by the segment (a resubmitted request restarts its RNG)."""
        done = len(so_far.token_ids)
        return Request(f"{first.request_id}#{segment}", first.prompt_ids + tuple(so_far.token_ids),
                       first.max_new_tokens - done,
                       request_seed(self.seed, self.step, sid, segment, turn),
                       max(0, first.min_new_tokens - done), first.stop_ids, first.stop_strings,
                       first.cache_salt)


# one request to completion: (sample id, its request, the policy turn) -> its completion
Complete = Callable[[int, Request, int], Awaitable[Completion]]
Turned = list[tuple[list[int], list[float], bool]]  # a policy turn's, as `PolicyTurn` returns


def episode_turns(requests: Requests, max_tokens: int, complete: Complete, tally: PrefillTally,
                  ) -> Callable[[int, list[Episode], list[int]], Coroutine[Any, Any, Turned]]:
    """Policy turns for `modeling.episodes.play`: one request per episode still running
    (`Requests.turn`), completed by `complete`, each row's prefill added to `tally`."""

    async def turn(k: int, eps: list[Episode], sids: list[int]) -> Turned:
        done = await asyncio.gather(*(complete(sid, requests.turn(k, e, sid, max_tokens), k)
                                      for e, sid in zip(eps, sids, strict=True)))
        tally.add(sids, done)
        return [(c.token_ids, c.logprobs, c.finish == "stop") for c in done]
    return turn


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


async def engine_rollout(engine: GenerationEngine, prompts: PromptBatch,
                         params: SamplingParams, seed: int, step: int) -> RolloutBatch:
    """The rollout of `prompts` on `engine` as it is now (no update lands during it): one
    response per row, or with `params.episode` one multi-turn episode per row (the
    environment's calls on this loop). Stamped with the engine's weight version."""
    version = engine.version
    # prefix-cache KV only from these weights
    requests = Requests(params, seed, step, f"{step}", version, "colocated")

    async def complete(sid: int, request: Request, turn: int) -> Completion:
        return await engine.generate(request)

    if params.episode is None:
        reqs = requests.rows(prompts)
        done = await asyncio.gather(*(engine.generate(r) for _, r in reqs))
        return assemble(prompts, list(done), params, step, version, partial=False)
    spec, tally = params.episode, PrefillTally()
    eps = await play(prompts, params, spec, seed, step,
                     episode_turns(requests, spec.max_tokens, complete, tally))
    return tally.onto(episode_batch(prompts, eps, spec.max_tokens, params.pad_id, version,
                                    step))
