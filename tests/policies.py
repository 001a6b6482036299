"""Comparing two trained policies that should have followed one trajectory.

Two runs that compute the same step in another float order (another batch shape, kernel
ISA, rank count or ZeRO's flat buffer) differ by a few ulps in each gradient. Where a
gradient is well away from zero, Adam's update (~ lr * g / |g|) hides that. Two cases
do not:

- the key bias of GPT-2's fused `c_attn`: it adds q.b to every score of a row alike, so
  softmax cancels it and its gradient is float noise (~1e-9), which Adam scales up to a
  sizeable fraction of lr of either sign, a different one per summation order. It carries
  no signal, so it is left out of the comparison;
- other near-zero gradients, when ranks sum in another order: the caller's `atol`, a
  fraction of lr, says how far one step's noise may move such a weight.
"""

from __future__ import annotations

import torch


def without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`, less the key third of a fused qkv bias (whose gradient is float noise)."""
    if not name.endswith("attn.c_attn.bias"):
        return t
    q, _, v = t.chunk(3)
    return torch.cat([q, v])


def assert_same_policy(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *,
                       atol: float = 1e-5, rtol: float = 1e-4, label: str = "") -> None:
    assert got.keys() == want.keys(), f"{label}: other parameter names"
    for k in want:
        torch.testing.assert_close(without_key_bias(k, got[k]), without_key_bias(k, want[k]),
                                   rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{label} {k}: {m}")
