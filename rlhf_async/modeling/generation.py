"""Our own sampling loop with a KV cache, returning behaviour log-probs.

Sampling is inverse-CDF: one uniform per (sample, position), drawn from a generator keyed
by (seed, step, sample id), so the same weights give the same tokens whatever the batch
composition, batch order or process split. One uniform per token (not one per vocabulary
entry, as Gumbel-max needs) keeps the noise tiny for 100k-token vocabularies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhf_async.modeling.determinism import keyed_uniform
from rlhf_async.modeling.models import cache_keyword, keep_logits
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch


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

    @property
    def stops(self) -> tuple[int, ...]:
        return (self.eos_id, *(s for s in self.stop_ids if s != self.eos_id))


@dataclass
class Generated:
    response_ids: Tensor  # [B, R] right-padded with pad_id after EOS
    response_mask: Tensor  # [B, R] 1 for real tokens (EOS included)
    logprobs: Tensor  # [B, R] log pi_behaviour(token); 0 on padding


def sampling_uniforms(seed: int, step: int, sample_ids: list[int], max_new_tokens: int) -> Tensor:
    """[B, R] uniforms; row b depends only on (seed, step, sample_ids[b])."""
    return keyed_uniform(seed, ("sample", step), sample_ids, (max_new_tokens,))


def _output_cache(out: object) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _scaled_logprobs(logits: Tensor, params: SamplingParams, t: int = 0) -> Tensor:
    """Log-probs the behaviour policy samples token `t` of a response from: temperature,
    then top-k, then the nucleus (top-p), with the stop tokens barred before
    `min_new_tokens`."""
    scaled = logits.float() / params.temperature
    if t < params.min_new_tokens:
        scaled[..., [s for s in params.stops if s < scaled.shape[-1]]] = float("-inf")
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
        # a token is out when the more likely ones already reach top_p (the first stays)
        out = probs.cumsum(dim=-1) - probs >= params.top_p
        scaled = scaled.masked_fill(out.scatter(-1, order, out), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


@torch.no_grad()
def sample(actor: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
           uniforms: Tensor) -> Generated:
    """Sample responses for left-padded prompts [B, P] using precomputed uniforms [B, R]."""
    was_training = actor.training
    actor.eval()
    B, R = prompt_ids.shape[0], params.max_new_tokens
    device = prompt_ids.device
    kw = cache_keyword(actor)
    mask = prompt_mask.long()
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = actor(input_ids=prompt_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **keep_logits(actor, 1))
    cache, logits = _output_cache(out), out.logits[:, -1]  # [B, V]
    next_pos = pos[:, -1:] + 1  # [B, 1]
    uniforms = uniforms.to(device)  # [B, R] float64

    tokens = torch.full((B, R), params.pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((B, R), dtype=torch.long, device=device)
    logprobs = torch.zeros((B, R), dtype=torch.float32, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(params.stops, dtype=torch.long, device=device)
    for t in range(R):
        logp = _scaled_logprobs(logits, params, t)  # [B, V]
        cdf = logp.double().exp().cumsum(dim=-1)  # [B, V]
        # Scale u by the row's total so rounding in the sum can never select past the end.
        target = uniforms[:, t: t + 1] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, target).squeeze(1).clamp(max=cdf.shape[-1] - 1)
        tok = torch.where(alive, tok, torch.full_like(tok, params.pad_id))
        tokens[:, t] = tok
        resp_mask[:, t] = alive.long()
        logprobs[:, t] = torch.where(alive, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        alive = alive & ~torch.isin(tok, stop_ids)
        if t == R - 1 or not bool(alive.any()):
            break
        # Finished rows keep stepping with a masked pad token so the batch stays rectangular.
        mask = torch.cat([mask, resp_mask[:, t: t + 1]], dim=1)
        out = actor(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                    use_cache=True, **{kw: cache})
        cache, logits = _output_cache(out), out.logits[:, -1]
        next_pos = next_pos + 1
    actor.train(was_training)
    return Generated(tokens, resp_mask, logprobs)


def generate(actor: nn.Module, prompts: PromptBatch, params: SamplingParams, seed: int,
             step: int, version: int) -> RolloutBatch:
    """Sample one response per row; noise keyed by (seed, step, sample id)."""
    ids = [int(s) for s in prompts.sample_ids]
    u = sampling_uniforms(seed, step, ids, params.max_new_tokens)
    g = sample(actor, prompts.prompt_ids, prompts.prompt_mask, params, u)
    return RolloutBatch(prompts.prompt_ids, prompts.prompt_mask, g.response_ids,
                        g.response_mask, g.logprobs, prompts.sample_ids, prompts.group_ids,
                        version=version, step=step)
