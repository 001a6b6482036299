"""Each model's numeric precision, as the placement gives it (`placement.dtype`).

A frozen model (reward, reference) or a shadow actor is *held* in its dtype: its weights are
cast once, and a weight broadcast into a shadow is cast by the copy. A trained model (actor,
critic) keeps fp32 master weights and an fp32 optimizer and *computes* in its dtype: its
forward passes run under `torch.autocast`. Log-probabilities, values and scores leave every
model as fp32, so the RL arithmetic downstream is the same in every precision.

fp16 is refused on CPU (no fast kernels there, and autocast on CPU takes bf16 only) and for
trained models (fp16 training needs loss scaling, which this build does not do); bf16 is
checked against the device when a model is placed on it, not when a plan is made.

On CPU a bf16 model's attention computes in fp32 (`cpu_attention`): torch's CPU attention
kernel is slower in bf16 than in fp32, 4x in its backward, while bf16 matmuls run up to 4x
faster than fp32 ones on CPUs with AVX-512 BF16 (bench/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from rlhf_async.modeling.cpu_attention import cpu_attention

M = TypeVar("M", bound=nn.Module)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
TRAINED = ("actor", "critic")


def dtype_problems(device_kind: str, model: str, dtype: str) -> list[str]:
    """What this build cannot run for `model` in `dtype` on `device_kind` ('cpu' | 'cuda')."""
    if dtype not in DTYPES:
        return [f"placement.dtype: {model}={dtype!r} is not one of {', '.join(DTYPES)}"]
    if dtype == "fp16" and model in TRAINED:
        return [f"placement.dtype: {model}=fp16 trains only with loss scaling, which this "
                "build does not do; use bf16 (autocast over fp32 master weights) or fp32"]
    if dtype == "fp16" and device_kind == "cpu":
        return [f"placement.dtype: {model}=fp16 is not run on cpu; use bf16 or fp32"]
    return []


@dataclass(frozen=True)
class Precision:
    """model name -> dtype name (fp32 for a model the mapping does not name)."""

    dtypes: Mapping[str, str] = field(default_factory=dict)

    def name(self, model: str) -> str:
        return self.dtypes.get(model, "fp32")

    def dtype(self, model: str) -> torch.dtype:
        return DTYPES[self.name(model)]

    def hold(self, model: str, module: M) -> M:
        """A frozen or shadow `module` cast to its dtype (in place, returned)."""
        return self.prepare(model, module.to(self.dtype(model)))

    def prepare(self, model: str, module: M) -> M:
        """`module` (held or computing in this precision) made ready for it: its attention
        runs `cpu_attention`'s kernel on CPU (in bf16: computing in fp32)."""
        cpu_attention(module)
        return module

    @contextlib.contextmanager
    def compute(self, model: str, device: torch.device) -> Iterator[None]:
        """Forward passes of the trained `model` in its dtype (fp32: as they are)."""
        if self.name(model) == "fp32":
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.dtype(model)):
            yield

    def to_dict(self) -> dict[str, str]:
        return dict(self.dtypes)


FP32 = Precision()


def check_device(precision: Precision, device: torch.device) -> None:
    """Raise ValueError when a model's dtype cannot run on this process's device."""
    if device.type == "cuda" and "bf16" in precision.dtypes.values() and \
            not torch.cuda.is_bf16_supported():
        raise ValueError(f"placement.dtype: bf16 is not supported by {device} "
                         f"({torch.cuda.get_device_name(device)}); use fp16 for frozen "
                         "models or fp32")
