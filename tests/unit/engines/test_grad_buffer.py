"""The torch engine's gradients in a group: summed in one kept buffer (GradBuffer), the
same update as without a group, step after step, into the same memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rlhf_async.engines.torch_train import TorchTrainBackend
from rlhf_async.modeling.collectives import GradBuffer

STEPS = 3


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
        self.unused = nn.Linear(2, 2)  # in no graph: a zero gradient on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(step))


def _train() -> tuple[dict, list[list[int]]]:
    model = _Model()
    engine = TorchTrainBackend(model, lr=0.1, weight_decay=0.0, grad_clip=0.5)
    ptrs = []
    for step in range(STEPS):
        for micro in _batch(step).chunk(2):  # two micro-batches accumulate before the step
            (model(micro).pow(2).sum() / 6).backward()
        engine.step()
        ptrs.append([0 if p.grad is None else p.grad.data_ptr() for p in engine.params])
    return {k: v.clone() for k, v in model.state_dict().items()}, ptrs


def test_in_a_group_gradients_live_in_one_kept_buffer_and_update_alike():
    """(Two ranks summing into it: tests/integration/test_flattening.py, 2 processes == 1.)"""
    alone, freed = _train()
    assert all(p == 0 for p in freed[-1])  # one process: gradients are freed after a step
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grouped, ptrs = _train()
    finally:
        dist.destroy_process_group()
    for name, value in alone.items():
        assert torch.allclose(grouped[name], value, atol=1e-7), name
    first, *rest = ptrs
    assert all(p == first for p in rest)  # the same memory every step: nothing reallocated
    assert 0 not in first  # the unused layer has a (zero) gradient view too


def test_a_buffer_rebinds_when_gradients_were_freed():
    p = nn.Parameter(torch.ones(3))
    buf = GradBuffer([p])
    assert not buf.zero()  # never bound: the caller frees the gradients
    p.grad = torch.full((3,), 2.0)
    buf._bind()
    assert buf.zero() and torch.equal(p.grad, torch.zeros(3))
    p.grad = None  # freed by someone else: bound no more
    assert not buf._bound()
    p.grad = torch.full((3,), 5.0)
    buf._bind()  # the current gradient survives a rebind
    assert torch.equal(p.grad, torch.full((3,), 5.0)) and buf._bound()
