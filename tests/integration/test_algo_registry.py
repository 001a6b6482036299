"""The algorithm's extension points end to end: an advantage estimator and a policy loss
registered from this file alone (one line each, `rl/registry.py`) train a tiny job when the
config names them, and a name nobody registered stops the job before any work with the
accepted names."""

from __future__ import annotations

import pytest
import torch

from rlhf_async import job
from rlhf_async.config import ConfigError
from rlhf_async.metrics import read_metrics
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageInputs
from rlhf_async.task.artefacts import stage_key
from tests.integration.test_algo_presets import _cfg, _weights

pytestmark = [pytest.mark.timeout(600)]

TOY_ADVANTAGE = 0.75  # on every token: no built-in estimator gives a constant


class Calls:
    def __init__(self) -> None:
        self.estimator: list[AdvantageInputs] = []
        self.loss: list[torch.Tensor] = []  # the advantages each loss call got

    def toy_estimator(self, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.estimator.append(x)
        return TOY_ADVANTAGE * x.mask.float(), None

    def toy_loss(self, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, /, *,
                 weights=None, ratio_level="token", loss_agg="token_mean", normaliser=None,
                 n_seqs=None):
        """REINFORCE: -A log pi, aggregated as asked; nothing is clipped."""
        self.loss.append(advantages.detach().clone())
        m = mask.float()
        n = m.sum() if normaliser is None else normaliser
        loss = A.aggregate(-advantages * logprobs, m, loss_agg, n,
                           float(m.shape[0]) if n_seqs is None else n_seqs)
        kl = (((old_logprobs - logprobs).detach()) * m).sum() / n
        return loss, {"clip_frac": m.new_zeros(()), "approx_kl": kl}


@pytest.fixture
def calls(monkeypatch):
    c = Calls()
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "toy", c.toy_estimator)
    monkeypatch.setitem(POLICY_LOSSES, "toy", c.toy_loss)
    return c


def test_a_registered_estimator_and_loss_train_a_job(tmp_path, cache, calls):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = _cfg(tmp_path, cache, "toy", "algo.name=grpo", "train.steps=2",
                   "placement.strategy=flattening", "algo.advantage_estimator=toy",
                   "algo.policy_loss=toy")
        job.run(cfg)
    finally:
        torch.set_num_threads(before)
    records = read_metrics(tmp_path / "toy" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert len(calls.estimator) == 2 and calls.loss  # one estimate per step, losses after
    for x in calls.estimator:  # grpo's recipe around it: group normalisation asked for
        assert x.group_norm and x.scores.shape == x.group_ids.shape == (x.mask.shape[0],)
    for adv in calls.loss:  # the loss got the estimator's advantages (grpo: no whitening)
        assert set(adv.unique().tolist()) <= {0.0, TOY_ADVANTAGE}
    for r in records:
        assert r["advantage_abs"] == pytest.approx(TOY_ADVANTAGE)
        assert r["clip_frac"] == 0.0 and r["actor_grad_norm"] > 0
    sft, policy = _weights(cache / stage_key(cfg, "sft")), _weights(tmp_path / "toy" / "policy")
    assert any(not torch.equal(sft[k], policy[k]) for k in sft)  # the toy loss trained it
    assert all(torch.isfinite(v).all() for v in policy.values())


@pytest.mark.parametrize(("key", "registry"), [("advantage_estimator", ADVANTAGE_ESTIMATORS),
                                               ("policy_loss", POLICY_LOSSES)])
def test_an_unregistered_name_stops_the_job_listing_the_accepted_ones(tmp_path, cache, calls,
                                                                      key, registry):
    cfg = _cfg(tmp_path, cache, "bad", f"algo.{key}=nope")
    with pytest.raises(ConfigError) as e:
        job.run(cfg)
    want = f"algo.{key}: unknown 'nope'; accepted: {', '.join(sorted(registry))}"
    assert any(p.startswith(want) for p in e.value.problems), e.value.problems
    assert "toy" in want  # what was registered at run time is accepted too
    assert not (tmp_path / "bad").exists()  # stopped before any work
