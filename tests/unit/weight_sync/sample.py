"""The tensors the weight-sync tests send: every dtype and shape kind a model holds (bf16,
fp16, fp32, int64, bool, a scalar, an empty tensor)."""

from __future__ import annotations

import torch


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(50, 16, generator=g).to(torch.bfloat16),  # 1600 B
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(3, generator=g).to(torch.float16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "count": torch.tensor([3, 4], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
