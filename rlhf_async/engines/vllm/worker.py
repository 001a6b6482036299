"""Runs INSIDE vLLM's worker processes: joins our weight-sync group and loads what it
receives into the live model, so the engine never restarts.

Passed to vLLM as `worker_extension_cls="rlhf_async.engines.vllm.worker.WeightSyncWorker"`
(vLLM mixes it into its Worker class). Importing it registers our bucketed broadcast as a
vLLM weight-transfer backend in the worker process (`engines/vllm/transfer.py`), which is
how `VLLMEngine` updates weights (vLLM's native API); the `rlhf_*` methods below serve the
engine (`engine.py`), which calls them through `collective_rpc`. The group is our
stateless torch group (gloo on CPU, NCCL on GPUs, built from a TCPStore the way vLLM's
`StatelessProcessGroup` is), so a trainer that is not part of vLLM's world can broadcast to
every tensor-parallel worker: each worker is its own rank and receives the full weights,
and the model's `load_weights` keeps the shard it owns.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from rlhf_async.engines.vllm.transfer import register
from rlhf_async.weight_sync import GroupSpec, make_receiver

register()


class WeightSyncWorker:
    """Methods mixed into a vLLM Worker (which provides `model_runner`, `rank`, `device`)."""

    model_runner: Any

    def _rlhf_model(self) -> Any:  # vLLM's model class, with load_weights(weights=...)
        return self.model_runner.model

    def rlhf_connect(self, spec: dict[str, Any], first_rank: int) -> int:
        """Join the broadcast group as rank first_rank + this worker's tensor-parallel rank."""
        gspec = GroupSpec.from_dict(spec)
        device = getattr(self, "device", None) or next(self._rlhf_model().parameters()).device
        if gspec.backend == "gloo":  # host buffers; load_weights copies to the device
            device = torch.device("cpu")
        old: Any = getattr(self, "_rlhf_receiver", None)
        if old is not None:
            old.close()
        self._rlhf_receiver: Any = make_receiver(gspec.backend, device=device)
        rank = first_rank + int(getattr(self, "rank", 0))
        self._rlhf_receiver.connect(gspec, rank)
        return rank

    def rlhf_receive(self, plan: dict[str, Any]) -> int:
        """Receive one bucketed update and load it into the running model; its version."""
        receiver = getattr(self, "_rlhf_receiver", None)
        if receiver is None:
            raise RuntimeError("rlhf_receive before rlhf_connect")
        got = receiver.receive(plan)
        self._rlhf_load(list(got.tensors.items()))
        return int(got.version)

    def rlhf_load(self, blob: bytes) -> None:
        """Weights sent with the call (a colocated trainer's state dict, `torch.save`d)
        into the live model."""
        tensors = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self._rlhf_load(list(tensors.items()))

    def _rlhf_load(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint-format (HF-named) tensors into the live model. Where the runner has
        `reload_weights` (vLLM >= 0.11) it is used: backends that repack weights after
        loading (the CPU one, quantised kernels) drop the per-parameter loaders that a
        plain `model.load_weights` needs; `reload_weights` redoes that processing."""
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        else:
            self._rlhf_model().load_weights(weights=items)

    def rlhf_close(self) -> None:
        receiver = getattr(self, "_rlhf_receiver", None)
        if receiver is not None:
            receiver.close()
            self._rlhf_receiver = None
