"""RLHF math as pure functions over tensors: advantages (GAE, group baselines), KL, the
clipped policy loss with its variants (clip-higher, sequence ratio, loss aggregation),
importance weights, the overlong penalty and learning-rate schedules.

Losses return a SUM of per-token terms divided by `normaliser` (default: the local token
count). Callers that split a global batch over ranks pass the GLOBAL token count, so that
summing gradients over ranks gives exactly the single-process gradient.
"""

from __future__ import annotations

import math
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


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Each row's mean over its valid tokens, broadcast back to [B, T] (0 for an empty row)."""
    m = mask.float()
    return ((x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0))[:, None].expand_as(x)


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """The learning rate of RL step `step` (from 0) of `total`, as a fraction of the base:
    (step + 1) / warmup during the warm-up, then constant 1, or linear / cosine from 1 to 0
    at `total` (so the last step still learns)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown learning-rate schedule {kind!r}; accepted: constant, linear, "
                     "cosine")


def importance_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float,
                       mode: str = "tis", mask: Tensor | None = None,
                       level: str = "token") -> Tensor:
    """Weights correcting for rollouts sampled by a behaviour policy mu other than the
    trainer's old policy (an older version, or the same weights in another engine/dtype),
    from the ratio pi_old / mu: tis = min(ratio, cap) (truncated IS); mis = the ratio where
    it is <= cap, 0 where above (masked IS). `level = sequence`: one ratio per response,
    exp of its mean log ratio over `mask`. Detached, [B, T]."""
    log_ratio = old_logprobs - behaviour_logprobs
    if level == "sequence":
        assert mask is not None, "a sequence-level ratio needs the response mask"
        log_ratio = sequence_mean(log_ratio, mask)
    ratio = torch.exp(log_ratio).detach()
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "mis":
        return torch.where(ratio > cap, torch.zeros_like(ratio), ratio)
    raise ValueError(f"unknown mismatch correction {mode!r}; accepted: tis, mis")


def stale_tokens(token_versions: Tensor | None, version: int, mask: Tensor,
                 sync_version: int) -> Tensor:
    """[B, T] bool: the policy tokens sampled by a weight version older than `sync_version`
    (the one a synchronous run would use): per token with partial rollouts'
    `token_versions`, else the batch's (oldest) `version` for every token."""
    real = mask > 0
    if token_versions is None:
        return real & (version < sync_version)
    return real & (token_versions < sync_version)


def proximal_weights(prox_logprobs: Tensor, behaviour_logprobs: Tensor, stale: Tensor,
                     cap: float, mode: str, mask: Tensor, level: str = "token") -> Tensor:
    """Decoupled PPO (AReaL, arXiv:2505.24298): the clip is centred on the proximal policy
    (the trainer's weights at the step's start: `prox_logprobs`), and the behaviour policy
    mu that sampled a stale token enters only as the importance weight pi_prox / mu, capped
    as `importance_weights` (`mode` tis | mis). 1 on fresh tokens (and, with `level =
    sequence`, on responses without a stale token); per response its stale tokens' log
    ratios over all its tokens. Detached, [B, T]."""
    behaviour = torch.where(stale, behaviour_logprobs, prox_logprobs)  # log ratio 0 if fresh
    w = importance_weights(prox_logprobs, behaviour, cap, mode, mask, level)
    if level == "sequence":
        stale = stale.any(dim=1, keepdim=True).expand_as(stale)
    return torch.where(stale, w, torch.ones_like(w))


def aggregate(per_token: Tensor, mask: Tensor, mode: str, n_tokens: Tensor | float,
              n_seqs: Tensor | float) -> Tensor:
    """One loss from per-token terms [B, T]: token_mean = sum / n_tokens; seq_mean_token_sum
    = sum of each response's sum / n_seqs; seq_mean_token_mean = sum of each response's
    mean / n_seqs. n_tokens, n_seqs: the GLOBAL counts of the minibatch (so that gradients
    summed over ranks and micro-batches are the whole minibatch's)."""
    x = per_token * mask.float()
    if mode == "token_mean":
        return x.sum() / n_tokens
    if mode == "seq_mean_token_sum":
        return x.sum() / n_seqs
    if mode == "seq_mean_token_mean":
        return (x.sum(dim=1) / mask.float().sum(dim=1).clamp(min=1.0)).sum() / n_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}; accepted: token_mean, "
                     "seq_mean_token_sum, seq_mean_token_mean")


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    clip_eps: float, clip_eps_high: float | None = None, *,
                    weights: Tensor | None = None, ratio_level: str = "token",
                    loss_agg: str = "token_mean", normaliser: Tensor | float | None = None,
                    n_seqs: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate -min(r A, clip(r, 1 - clip_eps, 1 + clip_eps_high) A) per token,
    times `weights` (mismatch / staleness correction), aggregated by `loss_agg`. The ratio r
    is per token, or with `ratio_level = sequence` the response's exp(mean log ratio)
    (GSPO). `normaliser`, `n_seqs`: global token and response counts (default: local).
    [B, T] inputs."""
    m = mask.float()
    n = m.sum() if normaliser is None else normaliser
    log_ratio = _log_ratio(logprobs, old_logprobs, m, ratio_level)
    ratio = torch.exp(log_ratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_eps, 1.0 + high) * advantages
    per_token = -torch.minimum(surr1, surr2)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, m, loss_agg, n, float(m.shape[0]) if n_seqs is None else n_seqs)
    with torch.no_grad():
        clipped = ((surr2 < surr1).float() * m).sum() / n
        approx_kl = (((ratio - 1) - log_ratio) * m).sum() / n
    return loss, {"clip_frac": clipped, "approx_kl": approx_kl}


def cispo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                      mask: Tensor, clip_low: float, clip_high: float, *,
                      weights: Tensor | None = None, ratio_level: str = "token",
                      loss_agg: str = "token_mean", normaliser: Tensor | float | None = None,
                      n_seqs: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4): -sg(clip(r, 1 - clip_low, 1 + clip_high))
    * A * log pi per token, times `weights`, aggregated by `loss_agg`. The importance weight
    is clipped and stop-gradiented instead of the token's update: every token keeps its
    gradient (PPO's clip zeroes a rising low-probability token's). Ratio and counts as
    `ppo_policy_loss`. [B, T] inputs."""
    m = mask.float()
    n = m.sum() if normaliser is None else normaliser
    log_ratio = _log_ratio(logprobs, old_logprobs, m, ratio_level)
    ratio = torch.exp(log_ratio).detach()
    per_token = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages * logprobs
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, m, loss_agg, n, float(m.shape[0]) if n_seqs is None else n_seqs)
    with torch.no_grad():
        clipped = (((ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low)).float() * m).sum() / n
        approx_kl = (((ratio - 1) - log_ratio) * m).sum() / n
    return loss, {"clip_frac": clipped, "approx_kl": approx_kl}


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, m: Tensor, ratio_level: str) -> Tensor:
    """log(pi / pi_old) per token, or each response's mean of it (`sequence`: GSPO)."""
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        return sequence_mean(log_ratio, m)
    if ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}; accepted: token, sequence")
    return log_ratio


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
    mean, std = _group_stats(scores, group_ids)
    return ((scores.double() - mean) / (std + eps)).to(scores.dtype)


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


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each response's group mean and unbiased group std of `scores`, [B] each, float64."""
    idx, G = _group_index(group_ids)
    s = scores.double()
    count = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, torch.ones_like(s))
    mean = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, s) / count
    dev = s - mean[idx]
    var = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, dev * dev) / (count - 1).clamp(min=1)
    return mean[idx], var.sqrt()[idx]


def outcome_advantages(scores: Tensor, group_ids: Tensor, baseline: str,
                       group_norm: bool, eps: float = 1e-6,
                       penalty: Tensor | None = None) -> Tensor:
    """One advantage per response [B] from its score: minus the group's mean (group_mean)
    or the other responses' mean (leave_one_out), or the score itself (none); with
    `group_norm`, divided by the std of the group's scores (+ eps).

    `penalty` [B] (the KL in the reward) is subtracted from the score; with `group_norm`
    it is subtracted from the normalised advantage instead, so the group's statistics are
    the task scores' alone: a group of equal scores has no task advantage, and the
    penalty's per-sample noise is not amplified by 1 / (its tiny std)."""
    if penalty is not None and not group_norm:
        return outcome_advantages(scores - penalty, group_ids, baseline, False, eps)
    if penalty is not None:
        return outcome_advantages(scores, group_ids, baseline, True, eps) - penalty
    if baseline == "group_mean" and group_norm:
        return grpo_advantages(scores, group_ids, eps)
    if baseline == "leave_one_out":
        adv = rloo_advantages(scores, group_ids)
    elif baseline == "group_mean":  # Dr. GRPO: the mean alone
        adv = (scores.double() - _group_stats(scores, group_ids)[0]).to(scores.dtype)
    elif baseline == "none":
        adv = scores.clone()
    else:
        raise ValueError(f"unknown baseline {baseline!r}; accepted: group_mean, "
                         "leave_one_out, none")
    if not group_norm:
        return adv
    return (adv.double() / (_group_stats(scores, group_ids)[1] + eps)).to(scores.dtype)


def episode_advantages(scores: Tensor, group_ids: Tensor, sample_ids: Tensor,
                       segments: Tensor | None, baseline: str, group_norm: bool,
                       penalty: Tensor | None = None) -> Tensor:
    """`outcome_advantages` [B] of a batch where rows with `segments` 0 hold earlier
    segments of an agent's episode (`RolloutBatch.episode_segments`): the group statistics
    are the episodes' (each once), and such a row takes its episode's advantage (with its
    own `penalty`)."""
    if segments is None or bool((segments != 0).all()):
        return outcome_advantages(scores, group_ids, baseline, group_norm, penalty=penalty)
    main = torch.nonzero(segments != 0).flatten()
    adv = outcome_advantages(scores[main], group_ids[main], baseline, group_norm,
                             penalty=None if penalty is None else penalty[main])
    row = {s: j for j, s in enumerate(sample_ids[main].tolist())}
    src = torch.tensor([row[s] for s in sample_ids.tolist()], device=scores.device)
    return adv[src] if penalty is None else adv[src] + penalty[main][src] - penalty


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int,
                     penalty: float) -> Tensor:
    """DAPO's soft overlong punishment [B]: 0 up to max_new_tokens - buffer tokens, then
    falling linearly to -penalty at max_new_tokens (and -penalty past it)."""
    excess = lengths.float() - (max_new_tokens - buffer)
    return -penalty * (excess / buffer).clamp(min=0.0, max=1.0)


def gather_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[token]. [B, T, V], [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
