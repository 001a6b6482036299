"""Our own sampling loop with a KV cache, returning behaviour log-probs.

Sampling is inverse-CDF: one uniform per (sample, position), drawn from a generator keyed
by (seed, step, sample id), so the same weights give the same tokens whatever the batch
composition, batch order or process split. One uniform per token (not one per vocabulary
entry, as Gumbel-max needs) keeps the noise tiny for 100k-token vocabularies.

A response ends at EOS, at a stop id, or at the token that completes a stop string. Stop
strings are matched on each row's own decoded tokens (a short trailing window of them, not
the whole response), so they keep that independence of the batch.

Partial rollouts (`between`): a generator may copy newly published weights into the module
between two decode steps. The rows go on from their KV cache as it is, although its prefix
was computed by the older weights (as in PipelineRL and AReaL; recomputing it would cost a
prefill). Each token records the version that sampled it and keeps the log-prob it was
sampled with, which is what the trainer's per-token IS correction divides by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.modeling.compiled_decode import compiled_decode_step, compiling
from rlhf_async.modeling.decode_step import DecodeStep, decode_step
from rlhf_async.modeling.determinism import key_seed, keyed_uniform
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.kv_cache import preallocated_cache
from rlhf_async.modeling.models import cache_keyword, keep_logits, output_cache
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.modeling.shared_prompts import prompt_groups

Decode = Callable[[list[int]], str]  # token ids -> text (a task's tokenizer)
# Partial rollouts: called on the sampling thread between two decode steps; applies any
# weights staged meanwhile (in place, into the same module) and returns the version the
# module holds now. The KV cache of the tokens so far stays as it is: it came from the
# older weights (as in PipelineRL and AReaL), only the tokens after the swap see the new.
Between = Callable[[], int]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    eos_id: int
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()  # end a response like EOS (kept in it)
    min_new_tokens: int = 0  # before this many tokens, EOS and the stop ids are not sampled
    stop_strings: tuple[str, ...] = ()  # end a response at the token completing one (kept)
    decode: Decode | None = field(default=None, compare=False, repr=False)  # for stop_strings
    # multi-turn episodes with an environment (`modeling/episodes.py`); None: one response
    episode: EpisodeSpec | None = field(default=None, compare=False, repr=False)

    @property
    def stops(self) -> tuple[int, ...]:
        return (self.eos_id, *(s for s in self.stop_ids if s != self.eos_id))


@dataclass
class Generated:
    response_ids: Tensor  # [B, R] right-padded with pad_id after EOS
    response_mask: Tensor  # [B, R] 1 for real tokens (EOS included)
    logprobs: Tensor  # [B, R] log pi_behaviour(token); 0 on padding
    token_versions: Tensor  # [B, R] long: weight version that sampled each token; -1 on pad


def sampling_uniforms(seed: int, step: int, sample_ids: list[int], max_new_tokens: int) -> Tensor:
    """[B, R] uniforms; row b depends only on (seed, step, sample_ids[b])."""
    return keyed_uniform(seed, ("sample", step), sample_ids, (max_new_tokens,))


def request_seed(seed: int, step: int, sample_id: int, segment: int = 0, turn: int = 0) -> int:
    """A request's sampling key (`engines.interface.Request.seed`). Segment 0 of turn 0
    keys the stream `sampling_uniforms` gives its row, so a request samples what `generate`
    samples for it; a later segment (the rest of a response resubmitted after an abort)
    or an episode's later policy turn its own."""
    if segment == 0 and turn == 0:
        return key_seed(seed, "sample", step, sample_id)
    return key_seed(seed, "sample", step, sample_id, "turn", turn, "segment", segment)


def scaled_logprobs(logits: Tensor, params: SamplingParams, early: Tensor | bool = False,
                    barred: Tensor | None = None) -> Tensor:
    """Log-probs [b, V] the behaviour policy samples a response's next token from:
    temperature, then top-k, then the nucleus (top-p), with the stop tokens barred where
    the token comes before `min_new_tokens` (`early`: for every row, or per row [b] bool;
    `barred`: the stop tokens' ids in the vocabulary, when the caller made them)."""
    scaled = logits.float() / params.temperature
    if early is not False and (early is True or bool(early.any())):
        if barred is None:
            barred = torch.tensor([s for s in params.stops if s < scaled.shape[-1]],
                                  dtype=torch.long, device=scaled.device)
        if early is True:
            scaled.index_fill_(-1, barred, float("-inf"))
        else:
            scaled[early.nonzero()[:, :1], barred[None, :]] = float("-inf")
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
        # a token is out when the more likely ones already reach top_p (the first stays)
        out = probs.cumsum(dim=-1) - probs >= params.top_p
        scaled = scaled.masked_fill(out.scatter(-1, order, out), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def completes_stop_string(ids: list[int], strings: tuple[str, ...], decode: Decode) -> bool:
    """Whether the last of `ids` (a response's newest tokens) completes one of `strings`:
    one occurs in their text and ends past the text of the tokens before the last."""
    text, before = decode(ids), decode(ids[:-1])
    # where the newest token's text begins: the first character the two texts differ in
    new = next((i for i, (a, b) in enumerate(zip(text, before, strict=False)) if a != b),
               min(len(text), len(before)))
    return any(text.find(s, max(0, new - len(s) + 1)) >= 0 for s in strings)


def stop_window(strings: tuple[str, ...]) -> int:
    """Trailing tokens to decode: a token adds at least one UTF-8 byte of text (but a
    special token the decoder skips), so a stop string the newest token completes lies
    within its byte length in tokens; two more of context so that the window's first
    token, decoded alone, cannot spoil it."""
    return max(len(s.encode()) for s in strings) + 2


def _string_stopped(tokens: Tensor, t: int, rows: Tensor, live: Tensor,
                    strings: tuple[str, ...], decode: Decode) -> Tensor:
    """[b] bool: the live ones of `rows` (rows of tokens [B, R]) whose token t completes one
    of `strings`, each judged on the trailing window of its own tokens."""
    start = max(0, t + 1 - stop_window(strings))
    windows = tokens[rows[live], start: t + 1].tolist()
    stopped = torch.zeros_like(live)
    stopped[live] = torch.tensor([completes_stop_string(ids, strings, decode)
                                  for ids in windows], dtype=torch.bool, device=live.device)
    return stopped


def inverse_cdf(logp: Tensor, u: Tensor) -> Tensor:
    """[b] token ids: where each row's uniform u [b] falls in its CDF, from logp [b, V]."""
    cdf = logp.double().exp().cumsum(dim=-1)  # [b, V]
    # Scale u by the row's total so rounding in the sum can never select past the end.
    target = u[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp(max=cdf.shape[-1] - 1)


def _step_for(actor: nn.Module, steps: int) -> DecodeStep | None:
    """The decode step of a call of `steps` steps: compiled where this process chose it
    (`compiled_decode.choose`), else eager."""
    return compiled_decode_step(actor, steps) if compiling() else decode_step(actor, steps)


class _Decoder:
    """The model and its KV cache for one `sample` call, chosen once after the prefill:
    our preallocated cache stepped by `decode_step` (HF's module tree skipped) where the
    architecture allows, else the model's own forward on whatever cache it returned. Rows
    leave the cache (`drop`) where the cache can re-index them."""

    def __init__(self, actor: nn.Module, cache: Any, fast: DecodeStep | None) -> None:
        self.actor, self.cache, self.fast = actor, cache, fast
        self.kw = cache_keyword(actor)
        self.droppable = hasattr(cache, "batch_select_indices")

    def reload(self, steps: int) -> None:
        """The module's weights changed in place (a partial rollout's swap): remake the
        fast step, whose packed weight copies (CPU) were taken from the old ones."""
        if self.fast is not None:
            self.fast = _step_for(self.actor, steps)

    def drop(self, keep: Tensor) -> None:
        """Keep only rows `keep` [b'] of the cache."""
        self.cache.batch_select_indices(keep)

    def step(self, tok: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        """Logits [b, V] after feeding tok [b] at positions pos [b, 1] (mask: [b, T])."""
        if self.fast is not None:
            return self.fast(tok, pos, mask, self.cache)
        out = self.actor(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                         use_cache=True, **{self.kw: self.cache})
        self.cache = output_cache(out)
        return out.logits[:, -1]


def prefill(actor: nn.Module, prompt_ids: Tensor, mask: Tensor, pos: Tensor,
            capacity: int) -> tuple[Any, Tensor, bool]:
    """Run the prompts [B, P] (mask [B, P], pos [B, P]) once: (their KV cache, logits
    [B, V] of each row's first response token, whether that cache is our preallocated one
    of `capacity` positions rather than the model's own). A prompt that repeats (a
    group's) is prefilled once and its cache rows copied."""
    kw, ours = cache_keyword(actor), preallocated_cache(actor, capacity)
    groups = None if ours is None else prompt_groups(actor, prompt_ids, mask)
    fill = slice(None) if groups is None else groups.first
    out = actor(input_ids=prompt_ids[fill], attention_mask=mask[fill], position_ids=pos[fill],
                use_cache=True, **keep_logits(actor, 1), **({} if ours is None else {kw: ours}))
    cache: Any = output_cache(out)  # ours, or the model's own (a Cache, or tuples)
    logits = out.logits[:, -1]  # [B, V] ([U, V] when shared)
    if groups is not None:
        cache.batch_select_indices(groups.inverse)
        logits = logits[groups.inverse]
    return cache, logits, ours is not None and cache is ours


def _prefill(actor: nn.Module, prompt_ids: Tensor, mask: Tensor, pos: Tensor,
             R: int) -> tuple[_Decoder, Tensor]:
    """`prefill` for a call of R new tokens: (the decoder, first logits [B, V])."""
    cache, logits, ours = prefill(actor, prompt_ids, mask, pos, prompt_ids.shape[1] + R)
    return _Decoder(actor, cache, _step_for(actor, R - 1) if ours else None), logits


@torch.no_grad()
def sample(actor: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
           uniforms: Tensor, version: int = 0, between: Between | None = None) -> Generated:
    """Sample responses for left-padded prompts [B, P] using precomputed uniforms [B, R].

    The model steps over the rows still decoding (`rows`): a finished row leaves its batch
    and KV cache (one index copy) instead of stepping on with a masked pad token. With a
    cache that cannot drop rows (older transformers) it stays with `live` false.

    `version`: the weights' version at the start. `between` (partial rollouts): called
    before every decode step, it may swap new weights into `actor`; the rows go on from
    their KV cache under them, and each token's version and behaviour log-prob are those
    of the weights that sampled it. The uniforms are keyed per (sample, position), so a
    swap that brings identical weights changes no token."""
    decode = params.decode
    if params.stop_strings and decode is None:
        raise ValueError("SamplingParams.stop_strings needs SamplingParams.decode (token ids "
                         "-> text) to match them")
    was_training = actor.training
    actor.eval()
    (B, P), R = prompt_ids.shape, params.max_new_tokens
    device = prompt_ids.device
    # the attention mask of every position, written one column per token (no regrowing)
    mask = torch.zeros((B, P + R), dtype=torch.long, device=device)  # [b, P + R]
    mask[:, :P] = prompt_mask
    pos = (mask[:, :P].cumsum(dim=1) - 1).clamp(min=0)
    decoder, logits = _prefill(actor, prompt_ids, mask[:, :P], pos, R)
    next_pos = pos[:, -1:] + 1  # [b, 1]
    uniforms = uniforms.to(device)  # [B, R] float64

    tokens = torch.full((B, R), params.pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((B, R), dtype=torch.long, device=device)
    logprobs = torch.zeros((B, R), dtype=torch.float32, device=device)
    versions = torch.full((B, R), -1, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # [b] the model batch's rows of the full batch
    whole = True  # rows is still every row in order: columns are written as slices
    live = torch.ones(B, dtype=torch.bool, device=device)  # [b] rows still in a response
    stop_ids = torch.tensor(params.stops, dtype=torch.long, device=device)
    barred = stop_ids[stop_ids < logits.shape[-1]]
    for t in range(R):
        logp = scaled_logprobs(logits, params, t < params.min_new_tokens, barred)  # [b, V]
        at = slice(None) if whole else rows
        tok = torch.where(live, inverse_cdf(logp, uniforms[at, t]), params.pad_id)  # [b]
        fed = live.long()  # [b] 1 = a response token, 0 = a finished row's pad
        tokens[at, t] = tok
        resp_mask[at, t] = fed
        logprobs[at, t] = torch.where(live, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        if between is not None:  # else all one version, filled in after the loop
            versions[at, t] = torch.where(live, version, -1)
        live = live & ~torch.isin(tok, stop_ids)
        if params.stop_strings and decode is not None and t >= params.min_new_tokens:
            live = live & ~_string_stopped(tokens, t, rows, live, params.stop_strings, decode)
        if t == R - 1 or not bool(live.any()):
            break
        mask[:, P + t] = fed
        if decoder.droppable and not bool(live.all()):
            keep = live.nonzero().flatten()  # [b'] the rows that go on
            decoder.drop(keep)
            rows, mask, tok, next_pos = rows[keep], mask[keep], tok[keep], next_pos[keep]
            live, whole = live[keep], False
        if between is not None and (now := between()) != version:
            version = now
            decoder.reload(R - 1)  # the call's length: the same packing choice as before
        logits = decoder.step(tok, next_pos, mask[:, : P + t + 1])
        next_pos = next_pos + 1
    actor.train(was_training)
    if between is None:
        versions = torch.where(resp_mask.bool(), version, -1)
    return Generated(tokens, resp_mask, logprobs, versions)


def generate(actor: nn.Module, prompts: PromptBatch, params: SamplingParams, seed: int,
             step: int, version: int, between: Between | None = None) -> RolloutBatch:
    """Sample one response per row; noise keyed by (seed, step, sample id). With `between`
    (partial rollouts, see `sample`) the batch carries `token_versions` and its `version`
    is its oldest token's."""
    ids = [int(s) for s in prompts.sample_ids]
    u = sampling_uniforms(seed, step, ids, params.max_new_tokens)
    g = sample(actor, prompts.prompt_ids, prompts.prompt_mask, params, u, version, between)
    return rollout_batch(prompts, g, step, version, partial=between is not None)


def rollout_batch(prompts: PromptBatch, g: Generated, step: int, version: int,
                  partial: bool) -> RolloutBatch:
    """The rollout of `prompts` sampled as `g`, from weights of `version`; with `partial`
    (partial rollouts) it carries `token_versions` and its `version` is its oldest
    token's."""
    versions = g.token_versions if partial else None
    if versions is not None and bool((real := versions >= 0).any()):
        version = int(versions[real].min())
    return RolloutBatch(prompts.prompt_ids, prompts.prompt_mask, g.response_ids,
                        g.response_mask, g.logprobs, prompts.sample_ids, prompts.group_ids,
                        version=version, step=step, token_versions=versions)
