"""Our bucketed broadcast as a vLLM weight-transfer backend (runs INSIDE vLLM's workers).

vLLM's native RL weight API (`AsyncLLM.init_weight_transfer_engine` / `start_weight_update`
/ `update_weights` / `finish_weight_update`) dispatches to a `WeightTransferEngine` chosen
by `weight_transfer_config.backend`. vLLM ships NCCL/IPC backends only (none over gloo,
and its NCCL path moves nothing on non-CUDA platforms), so we register ours: each worker
joins the trainer's weight-sync group (`rlhf_async.weight_sync`, gloo on CPU, NCCL on
CUDA) as rank first_rank + its tensor-parallel rank, receives the full bucketed update
and loads it through vLLM's layerwise reload (which redoes the backend's weight
repacking, e.g. the CPU kernels' layouts).

The factory's registry is per process, so `register()` runs where the workers import our
worker extension (`engines/vllm/worker.py`), before vLLM builds the transfer engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rlhf_async.weight_sync import GroupSpec, WeightReceiver, make_receiver

BACKEND = "rlhf_bucketed"


@dataclass
class BucketedInitInfo(WeightTransferInitInfo):
    spec: dict[str, Any] = field(default_factory=dict)  # GroupSpec.to_dict()
    first_rank: int = 1  # the rank of tensor-parallel worker 0


@dataclass
class BucketedUpdateInfo(WeightTransferUpdateInfo):
    plan: dict[str, Any] = field(default_factory=dict)  # the sender's plan dict


class BucketedBroadcastTransfer(WeightTransferEngine[BucketedInitInfo, BucketedUpdateInfo]):
    init_info_cls = BucketedInitInfo
    update_info_cls = BucketedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: WeightReceiver | None = None
        self.version = -1

    def init_transfer_engine(self, init_info: BucketedInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        spec = GroupSpec.from_dict(init_info.spec)
        # gloo moves host buffers; load_weights copies them to the model's device
        device = torch.device("cpu") if spec.backend == "gloo" else self.device
        self.shutdown()
        self.receiver = make_receiver(spec.backend, device=device)
        self.receiver.connect(spec, init_info.first_rank + get_tensor_model_parallel_rank())

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # torch.accelerator has nothing to wait for on CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: BucketedUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        got = self.receiver.receive(update_info.plan)
        self.model.load_weights(weights=list(got.tensors.items()))
        self.version = int(got.version)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def register() -> None:
    """Idempotent: the worker extension may be imported more than once per process."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, BucketedBroadcastTransfer)
