"""The losses `forward_backward` computes server-side, by name, as the Tinker API's loss
docs define them (https://tinker-docs.thinkingmachines.ai/tinker/losses and its pages
`importance-sampling`, `ppo`, `cispo`, `dro`; the input names and dtypes also in the SDK's
`tinker/types/datum.py` `_key_to_type`). Every loss is a sum over a datum's tokens, not a
mean: the client chooses its normalisation through `weights` / `advantages`.

A loss takes the learner's log-probs of the datum's `target_tokens` (`target_lp`, [N], with
gradient) and the datum's other inputs as tensors, and returns the per-token losses [N];
the server sums them (`loss:sum`) and returns `target_lp` as the datum's `logprobs`.

    cross_entropy        -w * lp                            inputs: weights (default 1)
    importance_sampling  -r * A,   r = exp(lp - q)          inputs: logprobs (q), advantages (A)
    ppo                  -min(r * A, clip(r, lo, hi) * A)   (lo, hi) default (0.8, 1.2)
    cispo                -sg(clip(r, lo, hi)) * lp * A      (lo, hi) default (0.0, 4.0)
    dro                  -(lp * A - beta / 2 * (lp - q)^2)  beta default 0.05

The clip thresholds are bounds on the ratio itself (`loss_fn_config = {"clip_low_threshold":
0.8, "clip_high_threshold": 1.2}`), as the docs' PPO page states (epsilon 0.2); a datum may
also carry them as inputs (per token or one value). CISPO's and DRO's defaults are the
values the docs' pages use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_async.ops.tinker.futures import UserError

Inputs = Mapping[str, Tensor]
_CLIP = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class Loss:
    fn: Callable[[Tensor, Inputs, Mapping[str, float]], Tensor]
    inputs: tuple[str, ...]  # loss_fn_inputs it needs besides target_tokens
    config: Mapping[str, float]  # loss_fn_config keys it takes, with their defaults


def _ratio(target_lp: Tensor, inputs: Inputs) -> Tensor:
    return torch.exp(target_lp - inputs["logprobs"])


def _clip(inputs: Inputs, config: Mapping[str, float]) -> tuple[Tensor, Tensor]:
    """(low, high): the datum's own thresholds where it has them, else the config's."""
    return tuple(inputs.get(k, torch.tensor(config[k])) for k in _CLIP)  # type: ignore[return-value]


def cross_entropy(target_lp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    return -inputs["weights"] * target_lp


def importance_sampling(target_lp: Tensor, inputs: Inputs,
                        config: Mapping[str, float]) -> Tensor:
    return -_ratio(target_lp, inputs) * inputs["advantages"]


def ppo(target_lp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    ratio, adv = _ratio(target_lp, inputs), inputs["advantages"]
    lo, hi = _clip(inputs, config)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


def cispo(target_lp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    lo, hi = _clip(inputs, config)
    weight = torch.clamp(_ratio(target_lp, inputs), lo, hi).detach()
    return -weight * target_lp * inputs["advantages"]


def dro(target_lp: Tensor, inputs: Inputs, config: Mapping[str, float]) -> Tensor:
    square = (target_lp - inputs["logprobs"]) ** 2
    return -(target_lp * inputs["advantages"] - 0.5 * config["beta"] * square)


LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(cross_entropy, ("weights",), {}),
    "importance_sampling": Loss(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": Loss(ppo, ("logprobs", "advantages"), dict(zip(_CLIP, (0.8, 1.2), strict=True))),
    "cispo": Loss(cispo, ("logprobs", "advantages"), dict(zip(_CLIP, (0.0, 4.0), strict=True))),
    "dro": Loss(dro, ("logprobs", "advantages"), {"beta": 0.05}),
}
OPTIONAL_INPUTS = {"cross_entropy": {"weights"}, "ppo": set(_CLIP), "cispo": set(_CLIP)}


def resolve(name: str, config: Mapping[str, float | str]) -> tuple[Loss, dict[str, float]]:
    """The loss and its full config; UserError for an unknown name or key, or a value that
    is not a number."""
    loss = LOSSES.get(name)
    if loss is None:
        raise UserError(f"unknown loss_fn {name!r}; this server computes "
                        f"{', '.join(LOSSES)} (forward_backward_custom runs any other "
                        "on the client)")
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        takes = ", ".join(loss.config) or "no loss_fn_config"
        raise UserError(f"loss_fn_config for {name}: unknown key(s) {', '.join(unknown)}; "
                        f"it takes {takes}")
    full = dict(loss.config)
    for key, value in config.items():
        if isinstance(value, str):
            raise UserError(f"loss_fn_config[{key!r}] for {name} must be a number, got "
                            f"{value!r}")
        full[key] = float(value)
    if "clip_low_threshold" in full and not \
            full["clip_low_threshold"] <= 1.0 <= full["clip_high_threshold"]:
        raise UserError(f"{name}: clip thresholds bound the ratio and must bracket 1 "
                        f"(clip_low_threshold <= 1 <= clip_high_threshold), got "
                        f"{full['clip_low_threshold']} and {full['clip_high_threshold']}")
    return loss, full


def datum_inputs(name: str, loss: Loss, arrays: Mapping[str, Tensor], n: int,
                 index: int) -> dict[str, Tensor]:
    """The datum's inputs as float tensors of [n] (a scalar threshold broadcast), checked;
    cross_entropy without weights weighs every token 1."""
    known = set(loss.inputs) | OPTIONAL_INPUTS.get(name, set()) | {"target_tokens"}
    extra = sorted(set(arrays) - known)
    if extra:
        takes = ", ".join(sorted(known))
        raise UserError(f"datum {index}: loss_fn_inputs {', '.join(extra)} are not inputs of "
                        f"{name} (it takes {takes})")
    out: dict[str, Tensor] = {}
    optional = OPTIONAL_INPUTS.get(name, set())
    for key in [*loss.inputs, *sorted(optional - set(loss.inputs))]:  # the first missing named
        if key not in arrays:
            if key in optional:
                if key == "weights":
                    out[key] = torch.ones(n)
                continue
            raise UserError(f"datum {index}: {name} needs loss_fn_inputs[{key!r}] ([N] "
                            "floats, one per target token)")
        t = arrays[key].to(torch.float32).reshape(-1)
        if key in _CLIP and t.numel() == 1:
            t = t.expand(n)
        if t.numel() != n:
            raise UserError(f"datum {index}: loss_fn_inputs[{key!r}] has {t.numel()} values "
                            f"for {n} target tokens")
        if not torch.isfinite(t).all():
            raise UserError(f"datum {index}: loss_fn_inputs[{key!r}] has non-finite values")
        out[key] = t
    return out
