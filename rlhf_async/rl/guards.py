"""Non-finite guards: one check per kind of value (rewards, advantages, losses, gradient
norms), each in the one place that value is made, so that a NaN or inf never reaches an
optimizer step. The policy (README "When a value is not finite"): the step stops with a
`NonFiniteError` naming the step and the value, before the weights change; the job ends
with that error, its checkpoints (all of finite weights) kept, and no final policy."""

from __future__ import annotations

import torch
from torch import Tensor


class NonFiniteError(ValueError):
    """A reward, advantage, loss or gradient norm is NaN or infinite."""


def require_finite(what: str, value: Tensor | float, step: int, hint: str = "",
                   ids: Tensor | None = None) -> None:
    """Raise `NonFiniteError` naming `step` and `what` unless every entry of `value` is
    finite; `ids` ([B]: sample ids of `value`'s rows) names the offending samples."""
    t = value if isinstance(value, Tensor) else torch.tensor(float(value))
    bad = ~torch.isfinite(t.detach())
    if not bool(bad.any()):
        return
    where = ""
    if ids is not None and t.dim() >= 1:
        rows = bad.reshape(bad.shape[0], -1).any(dim=1)
        where = f" (samples {ids[rows].tolist()[:8]})"
    first = t.detach()[bad].flatten()[0].item()
    raise NonFiniteError(f"step {step}: {what} is not finite ({first}){where}; no update was "
                         f"made from it{'; ' + hint if hint else ''}")
