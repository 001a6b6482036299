"""The plain-torch generation engine (CPU default): our keyed sampler over an HF module;
weight updates are received beside generation and copied in between two generate calls,
or, with partial rollouts, between two decode steps of one (the `between` hook)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.modeling.episodes import rollout
from rlhf_async.modeling.generation import Between, SamplingParams
from rlhf_async.modeling.rollout import PromptBatch, RolloutBatch
from rlhf_async.weight_sync import GroupSpec, load_into_module, make_receiver


class TorchGenerationBackend:
    name = "torch"

    def __init__(self, actor: nn.Module, params: SamplingParams, *, sync_backend: str,
                 device: torch.device) -> None:
        self.actor, self.params = actor, params
        self.receiver = make_receiver(sync_backend, device=device)

    def generate(self, prompts: PromptBatch, seed: int, step: int, version: int,
                 between: Between | None = None) -> RolloutBatch:
        """A chunk's rollout; `between` (partial rollouts): swaps staged weights in between
        two decode steps (see `modeling.generation.sample`)."""
        return rollout(self.actor, prompts, self.params, seed, step, version, between)

    def connect(self, spec: GroupSpec, rank: int) -> None:
        self.receiver.connect(spec, rank)

    def stage(self, plan: Mapping[str, Any]) -> tuple[int, dict[str, Tensor]]:
        """Receive an update while generation goes on; copied out of the receiver's staging
        buffer so the next update can land while this one waits for its swap."""
        got = self.receiver.receive(plan)
        return got.version, {k: v.clone() for k, v in got.tensors.items()}

    def swap(self, staged: tuple[int, dict[str, Tensor]]) -> int:
        """Apply a staged update (between generation steps); its version."""
        load_into_module(self.actor, staged[1])
        return staged[0]

    def close(self) -> None:
        self.receiver.close()
