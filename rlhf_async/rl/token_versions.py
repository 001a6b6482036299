"""Metrics of partial rollouts (`generation.partial_rollout`): how old each trained token's
weights were and how many responses took new weights mid-way.

A partial rollout's tokens carry the weight version that sampled them (`token_versions`);
staleness admission uses the oldest (the batch's `version`), so these numbers show what
that conservative rule hides: most tokens of an interrupted response are newer.
"""

from __future__ import annotations

from rlhf_async.modeling.rollout import POLICY, RolloutBatch


def token_version_metrics(batch: RolloutBatch, sync_version: int) -> dict[str, float]:
    """{} without token versions; else `partial/interrupted_rows` (responses sampled by more
    than one version), `partial/tokens_lag/<k>` (policy tokens sampled k versions behind
    `sync_version`, the version a synchronous run would use) and `partial/token_lag_mean`."""
    tv = batch.token_versions
    if tv is None:
        return {}
    real = batch.response_mask == POLICY
    newest = tv.masked_fill(~real, -1).max(dim=1).values
    oldest = tv.masked_fill(~real, 1 << 62).min(dim=1).values
    out = {"partial/interrupted_rows": float(((newest > oldest) & real.any(dim=1)).sum())}
    lags = sync_version - tv[real]
    if lags.numel():
        out["partial/token_lag_mean"] = float(lags.float().mean())
    for lag, n in zip(*lags.unique(return_counts=True), strict=True):
        out[f"partial/tokens_lag/{int(lag)}"] = float(n)
    return out
