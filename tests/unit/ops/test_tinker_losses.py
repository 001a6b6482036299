"""The Tinker API's server-side losses, value and gradient by hand (ops/tinker/losses.py),
on one datum of three tokens:

    learner lp = [-1.0, -2.0, -0.5]   sampler q = [-1.1, -2.0, -1.0]   A = [2, -1, 1]
    ratio r = exp(lp - q) = [e^0.1, 1, e^0.5] = [1.105171, 1, 1.648721]
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_async.ops.tinker import losses
from rlhf_async.ops.tinker.futures import UserError

LP = [-1.0, -2.0, -0.5]
INPUTS = {"logprobs": torch.tensor([-1.1, -2.0, -1.0]), "advantages": torch.tensor([2.0, -1.0, 1.0]),
          "weights": torch.tensor([1.0, 0.5, 0.0])}
E1, E5 = math.exp(0.1), math.exp(0.5)


def _run(name: str, config: dict[str, float | str] | None = None,
         inputs: dict[str, torch.Tensor] | None = None) -> tuple[float, list[float]]:
    loss, full = losses.resolve(name, config or {})
    lp = torch.tensor(LP, requires_grad=True)
    given = {k: v for k, v in (inputs or INPUTS).items() if k in loss.inputs or k.startswith("clip")}
    total = loss.fn(lp, given, full).sum()
    total.backward()
    assert lp.grad is not None
    return float(total), lp.grad.tolist()


@pytest.mark.parametrize(("name", "config", "value", "grad"), [
    # -(w . lp) = -(1 * -1 + 0.5 * -2) ; d/dlp = -w
    ("cross_entropy", None, 2.0, [-1.0, -0.5, 0.0]),
    # -(r . A) ; d/dlp = -r * A
    ("importance_sampling", None, -(2 * E1 - 1 + E5), [-2 * E1, 1.0, -E5]),
    # token 3: r = 1.6487 > 1.2 with A > 0, so min takes the clipped 1.2 * A (no gradient)
    ("ppo", None, -(2 * E1 - 1 + 1.2), [-2 * E1, 1.0, 0.0]),
    # default clip (0, 4) keeps every ratio: -(sg(r) * lp * A) ; d/dlp = -sg(r) * A
    ("cispo", None, -(-2 * E1 + 2 - 0.5 * E5), [-2 * E1, 1.0, -E5]),
    # clip (0.8, 1.2) caps token 3's weight at 1.2, its gradient still flows through lp
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
     -(-2 * E1 + 2 - 0.6), [-2 * E1, 1.0, -1.2]),
    # -(lp * A - beta / 2 * (lp - q)^2) ; d/dlp = -(A - beta * (lp - q)), beta 0.05 default
    ("dro", None, -(-2 - 0.025 * 0.01 + 2 - 0.5 - 0.025 * 0.25), [-1.995, 1.0, -0.975]),
    ("dro", {"beta": 1.0}, -(-2 - 0.005 + 2 - 0.5 - 0.125), [-1.9, 1.0, -0.5]),
], ids=["ce", "is", "ppo", "cispo", "cispo-clip", "dro", "dro-beta"])
def test_each_loss_by_hand(name: str, config: dict[str, float] | None, value: float,
                           grad: list[float]) -> None:
    got, got_grad = _run(name, config)
    assert got == pytest.approx(value, abs=1e-5)
    assert got_grad == pytest.approx(grad, abs=1e-5)


def test_ppo_thresholds_from_the_datum_override_the_config() -> None:
    # a datum's own clip_high_threshold of 1.05 clips token 1 too (r = 1.105, A = 2)
    inputs = {**INPUTS, "clip_high_threshold": torch.full((3,), 1.05),
              "clip_low_threshold": torch.full((3,), 0.8)}
    value, grad = _run("ppo", None, inputs)
    assert value == pytest.approx(-(2.1 - 1 + 1.05), abs=1e-5)
    assert grad == pytest.approx([0.0, 1.0, 0.0], abs=1e-5)


def test_the_registry_names_the_five_losses() -> None:
    assert list(losses.LOSSES) == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


@pytest.mark.parametrize(("name", "config", "message"), [
    ("gspo", {}, "unknown loss_fn 'gspo'; this server computes cross_entropy"),
    ("ppo", {"beta": 0.1}, "unknown key(s) beta; it takes clip_low_threshold"),
    ("dro", {"beta": "big"}, "must be a number"),
    ("cispo", {"clip_low_threshold": 1.1}, "must bracket 1"),
])
def test_a_bad_loss_or_config_is_a_user_error(name: str, config: dict[str, float | str],
                                              message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        losses.resolve(name, config)


def test_datum_inputs_are_checked_and_cross_entropy_weights_default_to_one() -> None:
    loss, _ = losses.resolve("cross_entropy", {})
    got = losses.datum_inputs("cross_entropy", loss, {}, 3, 0)
    assert got["weights"].tolist() == [1.0, 1.0, 1.0]
    is_loss, _ = losses.resolve("importance_sampling", {})
    with pytest.raises(UserError, match=r"datum 2: loss_fn_inputs\['advantages'\] has 2 values "
                                        "for 3 target tokens"):
        losses.datum_inputs("importance_sampling", is_loss,
                            {"logprobs": torch.zeros(3), "advantages": torch.zeros(2)}, 3, 2)
    with pytest.raises(UserError, match="non-finite"):
        losses.datum_inputs("importance_sampling", is_loss,
                            {"logprobs": torch.tensor([0.0, math.nan, 0.0]),
                             "advantages": torch.zeros(3)}, 3, 0)
    with pytest.raises(UserError, match="weights are not inputs of importance_sampling"):
        losses.datum_inputs("importance_sampling", is_loss,
                            {"logprobs": torch.zeros(3), "advantages": torch.zeros(3),
                             "weights": torch.ones(3)}, 3, 0)
