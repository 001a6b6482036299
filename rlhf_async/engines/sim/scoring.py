"""A simulated scorer's time: the reward model's and the reference's forwards over a
rollout chunk's rows, at the simulated lengths (each row's real response length mapped back
in proportion, as the sim engine mapped it out)."""

from __future__ import annotations

from rlhf_async.engines.sim.spec import SimSpec
from rlhf_async.modeling.rollout import RolloutBatch


def score_s(spec: SimSpec, batch: RolloutBatch, models: int) -> float:
    """Simulated seconds for `models` frozen forwards (reward and reference: 2; a rule
    reward instead of a reward model: 1) over `batch`."""
    real_max = int(batch.response_ids.shape[1])
    tokens = sum(spec.prompt_tokens + spec.sim_tokens(int(n), real_max)
                 for n in batch.response_mask.sum(dim=1).tolist())
    return models * spec.forward_s(tokens)
