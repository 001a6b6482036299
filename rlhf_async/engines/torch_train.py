"""The plain-torch training engine: AdamW on the module's parameters, gradients summed over
ranks by one all-reduce when torch.distributed is up (the CPU / CI default)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.modeling.collectives import GradBuffer

FUSED_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW (others: its loop)


class TorchTrainBackend:
    name = "torch"

    def __init__(self, module: nn.Module, *, lr: float, weight_decay: float,
                 grad_clip: float) -> None:
        self.module = self.model = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        # torch's fused kernel: one pass over each tensor, ~3x faster than the loop on CPU
        # (bench/README.md); the same update to float rounding
        fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay,
                                           fused=fused or None)
        self.grad_clip = grad_clip
        self.grads = GradBuffer(self.params)  # summed over ranks in place, kept across steps

    def backward(self, loss: Tensor, *, last: bool = True) -> None:
        loss.backward()  # micro-batch gradients accumulate in .grad until step()

    def step(self) -> float:
        self.grads.all_reduce()
        clip = self.grad_clip or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        if math.isfinite(norm):  # a NaN/inf gradient is never applied (the caller stops)
            self.optimizer.step()
        if not self.grads.zero():  # one process: the gradients are freed
            self.optimizer.zero_grad(set_to_none=True)
        return norm

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.module.state_dict())

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.module.load_state_dict(state)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(dict(state))

    def weight_layout(self) -> dict[str, Tensor]:
        """The state dict as meta tensors (names, dtypes, shapes), in `iter_weight_groups`
        order."""
        return {k: torch.empty_like(v, device="meta") for k, v in self.module.state_dict().items()}

    def iter_weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]:
        """The whole state dict as one group: nothing is sharded, nothing to gather (the
        tensors are the live weights, not copies)."""
        yield {k: v.detach() for k, v in self.module.state_dict().items()}

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing to release: plain torch modules and optimizers."""
