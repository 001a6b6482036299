"""Between a `torch.nn.Module` and the name -> tensor mapping the broadcast moves.

Why: a generator must never run with half-applied weights. Every name and shape is checked
against the model first and all problems are reported together; only when everything fits
are the tensors copied in, under `no_grad`, in one pass.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlhf_async.weight_sync.errors import WeightSyncPlanError


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer broadcasts: the module's state dict (parameters and persistent
    buffers), detached. Unwrap DDP (`model.module`) first so names match the generator."""
    return dict(module.state_dict())


def load_into_module(
    module: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy `weights` into `module` by name; all-or-nothing.

    Names present in the model but not in `weights` are an error when `strict`. Shapes must
    agree exactly; dtypes may differ (e.g. a bfloat16 trainer feeding a float16 generator)
    and are cast by the copy.
    """
    targets = module.state_dict(keep_vars=True)
    problems = [f"unexpected tensor {n!r} (not in the model)" for n in weights if n not in targets]
    if strict:
        problems += [f"missing tensor {n!r}" for n in targets if n not in weights]
    for name, src in weights.items():
        dst = targets.get(name)
        if dst is not None and tuple(dst.shape) != tuple(src.shape):
            problems.append(
                f"{name}: shape {list(src.shape)} does not fit model's {list(dst.shape)}"
            )
    if problems:
        shown = problems[:20] + (
            [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        )
        raise WeightSyncPlanError(
            f"received weights do not fit {type(module).__name__}: " + "; ".join(shown)
        )
    with torch.no_grad():
        for name, src in weights.items():
            targets[name].copy_(src)
