"""One training step's global metrics (`Learner.train_step`): every statistic reduced over
the ranks in one collective, so N ranks report what one rank holding the batch would."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_async.modeling.collectives import all_gather_1d, all_reduce_sum
from rlhf_async.modeling.episodes import ENDS
from rlhf_async.modeling.flops import token_counts
from rlhf_async.modeling.rollout import PREFILL_COUNTS, RolloutBatch
from rlhf_async.rl import algorithms as A

SUMS = ("episodes/", "kv/", "tokens/", "attn_pairs/")  # reported as global sums, not means


def global_stats(b: RolloutBatch, kl: Tensor, adv: Tensor, sums: dict[str, Tensor],
                 n_updates: int) -> dict[str, float]:
    """One all-reduce for every metric: per-sample sums + counts, loss partial sums."""
    m = b.loss_mask
    assert b.rewards is not None
    per_sample = {"reward": b.rewards.float(), "kl": kl.sum(dim=1),
                  "response_length": m.sum(dim=1), "advantage_abs": (adv.abs() * m).sum(1)
                  / m.sum(1).clamp(min=1)}
    if b.hidden_scores is not None:
        per_sample["hidden_score"] = b.hidden_scores.float()
    # an agent's earlier segments (episode_segments 0) are rows, not episodes
    episode = m.new_ones(len(b)) if b.episode_segments is None else \
        (b.episode_segments != 0).float()
    if b.episode_ends is not None:  # how many episodes ended each way (counts, not means)
        for code, how in enumerate(ENDS):
            per_sample[f"episodes/{how}"] = (b.episode_ends == code).float() * episode
    if b.episode_segments is not None:  # agents that rewrote their history (a new segment)
        per_sample["episodes/new_segments"] = (b.episode_segments - 1).clamp(min=0).float()
    if b.prefill_counts is not None:  # prompt KV reused from a prefix cache (counts)
        for j, name in enumerate(PREFILL_COUNTS):
            per_sample[f"kv/{name}"] = b.prefill_counts[:, j].float()
    # the step's tokens and attention pairs (sums): what its model FLOPs are counted from
    per_sample.update(token_counts(b.prompt_mask, b.response_mask))
    # rows with a token to train on (a failed agent episode has none): what throughput counts
    trained = (m.sum(dim=1) > 0).float().sum()
    vec = torch.stack([v.sum() for v in per_sample.values()] + list(sums.values())
                      + [trained, m.new_tensor(float(len(b)))])
    vec = all_reduce_sum(vec.double())
    count = vec[-1].clamp(min=1.0)
    out = {k: float(vec[i] if k.startswith(SUMS) else vec[i] / count)
           for i, k in enumerate(per_sample)}
    if b.prefill_counts is not None:
        prompt = out["kv/reused_tokens"] + out["kv/prefilled_tokens"]
        out["kv/reused_frac"] = out["kv/reused_tokens"] / prompt if prompt else 0.0
    out.update({k: float(vec[len(per_sample) + i] / n_updates)
                for i, k in enumerate(sums)})
    out["samples"], out["trained_samples"] = float(vec[-1]), float(vec[-2])
    return out


def mismatch_stats(b: RolloutBatch, old_lp: Tensor, ratio_level: str, cap: float,
                   ) -> dict[str, float]:
    """The gap between the generator's and the trainer's log-probs of this batch: mean
    and max of pi_old / mu over its tokens (per response with ratio_level = sequence),
    and the fraction above `cap` (algo.mismatch_cap) (what TIS truncates and MIS drops)."""
    m = b.loss_mask
    log_ratio = old_lp - b.behaviour_logprobs
    if ratio_level == "sequence":
        log_ratio = A.sequence_mean(log_ratio, m)
    ratio = torch.exp(log_ratio) * m
    capped = (ratio > cap).float() * m
    sums = all_reduce_sum(torch.stack([ratio.sum(), capped.sum(), m.sum()]).double())
    peak = ratio.max().reshape(1) if ratio.numel() else m.new_zeros(1)
    n = sums[2].clamp(min=1.0)
    return {"mismatch/ratio_mean": float(sums[0] / n),
            "mismatch/ratio_max": float(all_gather_1d(peak).max()),
            "mismatch/capped_frac": float(sums[1] / n)}
