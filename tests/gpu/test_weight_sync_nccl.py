"""NCCL path of the weight broadcast: same code as gloo, CUDA buffers. Skips without CUDA.

NCCL refuses two ranks of one communicator on the same GPU, so the broadcast test needs two
devices; the packing test runs on one.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
    load_into_module,
)
from rlhf_async.weight_sync.plan import (
    as_bytes,
    build_layout,
    pack_bucket,
    pieces_per_bucket,
    views,
)

pytestmark = pytest.mark.gpu


def _weights(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(300, 64, generator=g).to(device, torch.bfloat16),
        "w": torch.randn(64, 64, generator=g).to(device),
        "h": torch.randn(10, generator=g).to(device, torch.float16),
    }


def test_cuda_pack_view_and_load() -> None:
    tensors = _weights("cuda")
    layout = build_layout(tensors, 4096)
    sources = [as_bytes(tensors[s.name]) for s in layout.slots]
    stream = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda")
    for (lo, size), pieces in zip(layout.buckets, pieces_per_bucket(layout), strict=True):
        pack_bucket(stream[lo : lo + size], pieces, sources)
    got = views(stream, layout)
    for name, t in tensors.items():
        assert torch.equal(got[name], t)
    model = torch.nn.Module()
    for name, t in tensors.items():
        model.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t)))
    load_into_module(model, got)
    assert all(torch.equal(getattr(model, n), t) for n, t in tensors.items())


def _receiver(spec: dict[str, Any], out: Any) -> None:
    torch.cuda.set_device(1)
    rx = TorchBroadcastReceiver("nccl", device="cuda:1")
    rx.connect(GroupSpec.from_dict(spec), 1)
    plans = out.get(timeout=120)
    versions = []
    for plan in plans:
        received = rx.receive(plan)
        ok = all(torch.equal(received.tensors[n], t) for n, t in _weights("cuda:1").items())
        versions.append((received.version, ok))
    rx.close()
    out.put(versions)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs for two ranks")
def test_nccl_broadcast_between_two_gpus() -> None:
    torch.cuda.set_device(0)
    sender = TorchBroadcastSender("nccl", device="cuda:0", bucket_mb=4096 / 2**20)
    spec = sender.prepare(GroupSpec("nccl", "127.0.0.1", 0, 2, timeout_s=60))
    ctx = mp.get_context("spawn")
    chan = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(spec.to_dict(), chan))
    proc.start()
    try:
        sender.connect(spec)
        weights = _weights("cuda:0")
        plans = [sender.plan(weights, v) for v in (1, 2)]
        chan.put(plans)
        for plan in plans:
            sender.send(weights, plan)
        proc.join(120)
        assert chan.get(timeout=10) == [(1, True), (2, True)]
        assert sender.buffers_allocated == 1
    finally:
        sender.close()
        if proc.is_alive():
            proc.kill()
