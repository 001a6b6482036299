"""The request-level generation engine interface: what the generator node schedules over.

A generation engine serves one policy and answers requests: a prompt's token ids in, the
sampled token ids out, each with its behaviour log-prob (the sampler's processed
distribution: after temperature, top-k and top-p) and the weight version that sampled it.
Everything a rollout needs above that (chunks, multi-turn episodes, partial rollouts with
in-flight weight updates, staleness bounds) is written once, in the generator node, over
this interface; an engine only generates, pauses, and takes weights.

Weight updates come in two halves, so receiving overlaps generation: `stage(plan)` receives
an update beside running requests (may block a thread, never the event loop), then
`commit(staged)` copies it in at a decode boundary (running requests keep their state and
go on under the new weights; their later tokens carry the new version) and returns the
version now served. An engine that cannot keep requests across an update says so in its
capabilities (`keep_on_update = False`); the node then aborts and resubmits them with the
generated prefix.

A colocated lock-step rank (Flattening, Interleaving) hands its engine the trained weights
in process instead (`stage_tensors`, then `commit`), and lets it sleep while it trains.

A new engine is one module implementing `GenerationEngine` plus one line in `ENGINES`
(`engines/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from torch import Tensor

Finish = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Request:
    """One sequence to continue. `seed` is the request's own sampling key, derived by the
    caller from (run seed, step, sample id, segment) with `modeling.determinism.key_seed`,
    so a row's tokens never depend on which requests share its batch."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int
    min_new_tokens: int = 0  # before this many tokens, EOS and the stop ids are not sampled
    stop_ids: tuple[int, ...] = ()  # end the response like EOS (kept in it)
    stop_strings: tuple[str, ...] = ()  # end at the token completing one (kept)
    # the prefix cache may reuse KV only from requests with the same salt: the caller salts
    # with the weight version (and lineage), so no KV from older weights is ever reused
    cache_salt: str | None = None


@dataclass(frozen=True)
class Prefill:
    """What prefilling prompts cost: tokens computed, tokens whose KV a prefix cache
    supplied (an episode's earlier turns, a group's shared prompt), and of the requests,
    how many reused some KV (hits) and how many none (misses). Added over a row's requests
    (turns, resubmissions), it is the row's `RolloutBatch.prefill_counts` (its columns
    `PREFILL_COUNTS`, in this order)."""

    prefilled: int = 0
    reused: int = 0
    hits: int = 0
    misses: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, reused: int) -> Prefill:
        """One request's: `reused` of its `prompt_tokens` came from the cache."""
        return cls(prompt_tokens - reused, reused, int(reused > 0), int(reused == 0))

    def __add__(self, other: Prefill) -> Prefill:
        return Prefill(self.prefilled + other.prefilled, self.reused + other.reused,
                       self.hits + other.hits, self.misses + other.misses)


@dataclass
class Completion:
    """What a request produced; the three lists are aligned, one entry per token."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log pi(token)
    versions: list[int] = field(default_factory=list)  # weight version per token
    finish: Finish = "length"  # "stop": EOS / stop id / stop string; "abort": cut short
    prefill: Prefill = Prefill()  # its prompt's prefill, as the engine ran it


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do; the node and the config checks ask these, never its name."""

    keep_on_update: bool  # commit() keeps running requests (else abort + resubmit)
    stop_strings: bool  # matches Request.stop_strings itself
    prefix_cache: bool  # reuses KV across requests with a shared prefix and cache_salt
    tensor_parallel: bool  # one engine may span several devices
    devices: tuple[str, ...] = ("cpu", "cuda")
    # per device kind, the attention head sizes its kernels take (a kind not named: any)
    head_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def runs_head_size(self, device: str, head_size: int | None) -> bool:
        """Whether a model with `head_size` (None: unknown, not held against it) runs here."""
        sizes = self.head_sizes.get(device)
        return head_size is None or sizes is None or head_size in sizes


class GenerationEngine(Protocol):
    """A policy served request by request (see the module docstring)."""

    name: str
    capabilities: Capabilities

    async def generate(self, request: Request) -> Completion: ...
    async def abort(self, request_id: str) -> None: ...  # its generate() returns "abort"
    async def pause(self) -> None: ...  # no decode step runs until resume(); state kept
    async def resume(self) -> None: ...
    def connect(self, spec: Any, rank: int) -> Any: ...  # join the weight-sync group
    def stage(self, plan: Mapping[str, Any]) -> Any: ...  # receive an update (blocking)
    # an update from this process's tensors (a colocated trainer's, checkpoint names)
    def stage_tensors(self, tensors: Mapping[str, Tensor], version: int) -> Any: ...
    async def commit(self, staged: Any) -> int: ...  # apply at a decode boundary -> version
    async def sleep(self) -> None: ...  # free generation memory while a colocated rank trains
    async def wake(self) -> None: ...  # before generating again
    @property
    def version(self) -> int: ...  # the weight version served now
    async def close(self) -> None: ...
