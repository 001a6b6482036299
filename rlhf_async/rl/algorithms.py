"""RLHF math as pure functions over tensors: advantages, KL, PPO/GRPO/RLOO losses.

Losses return a SUM of per-token terms divided by `normaliser` (default: the local token
count). Callers that split a global batch over ranks pass the GLOBAL token count, so that
summing gradients over ranks gives exactly the single-process gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Reducer = Callable[[Tensor], Tensor]


def _identity(t: Tensor) -> Tensor:
    return t


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor, reduce: Reducer = _identity) -> Tensor:
    """Mean of x where mask=1; `reduce` sums [sum, count] over ranks (identity when local)."""
    stats = reduce(torch.stack([masked_sum(x.float(), mask), mask.float().sum()]))
    return stats[0] / stats[1].clamp(min=1.0)


def whiten(x: Tensor, mask: Tensor, reduce: Reducer = _identity, shift_mean: bool = True,
           eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries of the whole (global) batch; 0 where masked."""
    m = mask.float()
    stats = reduce(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).double())
    n = stats[2].clamp(min=1.0)
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean).clamp(min=0.0)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var + eps).to(x.dtype)
    if not shift_mean:
        out = out + mean.to(x.dtype)
    return out * m


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded sequences.

    rewards, values, mask: [B, T]. The value after the last valid token is 0 (episode end).
    Masked tokens inside a sequence (a multi-turn episode's environment tokens) are skipped:
    the policy token before them bootstraps from the next policy token after them.
    Returns (advantages, returns), both [B, T], zero on padding.
    """
    m = mask.float()
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        on = m[:, t] > 0
        last = torch.where(on, delta + gamma * lam * last, last)
        adv[:, t] = last * m[:, t]
        next_value = torch.where(on, values[:, t], next_value)
    returns = (adv + values) * m
    return adv, returns


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens: k1 = log r, k3 = r' - 1 - log r'."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; accepted: k1, k3")


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards: -kl_coef * kl everywhere, plus the sequence score on the last token.

    scores: [B]; kl, mask: [B, T]. Sequences with no valid token get nothing.
    """
    m = mask.float()
    r = -kl_coef * kl * m
    has = m.sum(dim=1) > 0
    # the last valid token (a multi-turn episode's mask has holes: its environment tokens)
    last = m.shape[1] - 1 - (m.flip(1) > 0).long().argmax(dim=1)
    rows = torch.arange(r.shape[0], device=r.device)
    r[rows[has], last[has]] += scores[has].to(r.dtype)
    return r


def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: float,
                     floor: float = 0.0) -> float:
    """Next KL coefficient of the adaptive controller (Ziegler et al. 2019): raise it when
    the measured KL per sample is above `target`, lower it when below, by a proportional
    error clipped to +-20% and scaled by 1/horizon (in steps), so the coefficient moves
    by at most 20%/horizon per step; never below `floor`. Without a floor the early steps
    (KL still below target) wear the coefficient down to nothing just before the policy
    finds a reward-model exploit, and it comes back too late (measured: bench/README.md)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return max(floor, coef * (1.0 + error / horizon))


def importance_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated IS weights min(pi_old / mu, cap) correcting for a stale behaviour policy."""
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap).detach()


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    clip_eps: float, behaviour_logprobs: Tensor | None = None,
                    is_cap: float = 0.0,
                    normaliser: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate; with behaviour_logprobs and is_cap > 0, tokens are weighted by
    min(pi_old/mu, is_cap) (truncated IS for rollouts from an older policy mu). [B, T] inputs."""
    m = mask.float()
    n = m.sum() if normaliser is None else normaliser
    ratio = torch.exp(logprobs - old_logprobs)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(surr1, surr2)
    if behaviour_logprobs is not None and is_cap > 0:
        per_token = per_token * importance_weights(old_logprobs, behaviour_logprobs, is_cap)
    loss = (per_token * m).sum() / n
    with torch.no_grad():
        clipped = ((surr2 < surr1).float() * m).sum() / n
        approx_kl = (((ratio - 1) - (logprobs - old_logprobs)) * m).sum() / n
    return loss, {"clip_frac": clipped, "approx_kl": approx_kl}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float, normaliser: Tensor | float | None = None) -> Tensor:
    """0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), masked. [B, T] inputs."""
    m = mask.float()
    n = m.sum() if normaliser is None else normaliser
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return (per_token * m).sum() / n


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position. [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def masked_token_mean(x: Tensor, mask: Tensor, normaliser: Tensor | float | None = None) -> Tensor:
    m = mask.float()
    return (x * m).sum() / (m.sum() if normaliser is None else normaliser)


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def grpo_advantages(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps); std is the unbiased sample std. [B] -> [B]."""
    idx, G = _group_index(group_ids)
    s = scores.double()
    count = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, torch.ones_like(s))
    mean = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, s) / count
    dev = s - mean[idx]
    var = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, dev * dev) / (count - 1).clamp(min=1)
    return (dev / (var.sqrt()[idx] + eps)).to(scores.dtype)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """r_i - mean of the OTHER responses to the same prompt (leave-one-out baseline)."""
    idx, G = _group_index(group_ids)
    s = scores.double()
    count = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, torch.ones_like(s))
    total = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, s)
    if bool((count < 2).any()):
        raise ValueError("RLOO needs at least 2 responses per prompt (group)")
    baseline = (total[idx] - s) / (count[idx] - 1)
    return (s - baseline).to(scores.dtype)


def gather_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[token]. [B, T, V], [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
