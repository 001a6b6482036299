"""The simulated training backend (`train.backend = sim`, on `placement.device = sim`): the
small real model of the job (the task's actor or critic) trained by the plain torch engine,
so losses, gradients, checkpoints and the weight-sync group's buckets are real; each
optimizer step also takes the time the cost model gives one update of the simulated model
on its data-parallel ranks (compute, the gradients' all-reduce, ZeRO-3 where the states do
not fit, the optimizer), and each weight broadcast the time the simulated model's bf16
bytes take over the modelled link (NVLink inside a node, the NIC across).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from rlhf_async.engines.sim.spec import SimSpec, active
from rlhf_async.engines.torch_train import TorchTrainBackend


class SimTrainBackend:
    name = "sim"

    def __init__(self, module: nn.Module, *, lr: float, weight_decay: float,
                 grad_clip: float, spec: SimSpec | None = None, ranks: int | None = None,
                 ) -> None:
        self.spec = spec or active()
        self.inner = TorchTrainBackend(module, lr=lr, weight_decay=weight_decay,
                                       grad_clip=grad_clip)
        self.module = self.model = module
        # the trainer ranks' group, joined before the learner is built
        self.ranks = ranks or (dist.get_world_size() if dist.is_initialized() else 1)
        updates = self.spec.epochs * self.spec.minibatches
        self.update_s = self.spec.train_step_s(self.ranks) / updates  # simulated, per step()
        self.spent = 0.0  # real seconds of this update's backward passes so far

    def backward(self, loss: Tensor, *, last: bool = True) -> None:
        t0 = time.perf_counter()
        self.inner.backward(loss, last=last)
        self.spent += time.perf_counter() - t0

    def step(self) -> float:
        """The real update, then the rest of the simulated update's time (the real
        backward and update ran inside it; on the learner's thread: the loop goes on)."""
        t0 = time.perf_counter()
        norm = self.inner.step()
        self.spec.sleep(self.update_s, self.spent + time.perf_counter() - t0)
        self.spent = 0.0
        return norm

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def state_dict(self) -> dict[str, Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.inner.load_state_dict(state)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.inner.optimizer_state_dict()

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_optimizer_state_dict(state)

    def weight_layout(self) -> dict[str, Tensor]:
        return self.inner.weight_layout()

    def iter_weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]:
        """The real buckets, after the simulated model's bytes have crossed the link."""
        self.spec.sleep(self.spec.broadcast_s())  # (the real buckets' own time comes after)
        yield from self.inner.iter_weight_groups(max_bytes)

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.gathered()

    def close(self) -> None:
        self.inner.close()
