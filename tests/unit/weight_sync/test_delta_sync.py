"""Delta updates over a real gloo group between threads: several versions of random sparse
updates (bf16 and fp32) arrive bit-identical to a full update, tied weights travel once,
and a receiver without the delta's base refuses it (never wrong weights) until a regroup
brings a full update."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from rlhf_async.weight_sync import (
    GroupSpec,
    TorchBroadcastReceiver,
    TorchBroadcastSender,
)
from rlhf_async.weight_sync.encoded import HEADER_BYTES
from rlhf_async.weight_sync.errors import WeightSyncBaseMismatch
from rlhf_async.weight_sync.plan import build_layout, tied_names


def _threads(fns: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(fns)

    def wrap(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as exc:
            out[i] = exc

    ts = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    emb = torch.randn(300, 16, generator=g).to(torch.bfloat16)
    return {"emb": emb, "w": torch.randn(40, 30, generator=g), "b": torch.zeros(7),
            "head": emb}  # tied: the same tensor under two names


def _step(ws: dict[str, torch.Tensor], g: torch.Generator, frac: float) -> None:
    for name, t in ws.items():
        if name == "head":
            continue
        hit = torch.rand(t.shape, generator=g) < frac
        t.copy_(torch.where(hit, t + (torch.randn(t.shape, generator=g) * 0.1).to(t.dtype), t))


class _Group:
    def __init__(self, n: int = 2) -> None:
        self.sender = TorchBroadcastSender("gloo", bucket_mb=2048 / 2**20, delta=True)
        self.spec = self.sender.prepare(GroupSpec("gloo", "127.0.0.1", 0, n + 1, timeout_s=20))
        self.rx = [TorchBroadcastReceiver("gloo") for _ in range(n)]
        self.connect()

    def connect(self) -> None:
        self.spec = self.spec.with_epoch(self.spec.epoch + 1)
        out = _threads([lambda: self.sender.connect(self.spec)]
                       + [lambda r=r: self.rx[r].connect(self.spec, r + 1)
                          for r in range(len(self.rx))])
        assert out == [None] * len(out)

    def update(self, ws: dict[str, torch.Tensor], version: int) -> tuple[dict, list[Any]]:
        plan = msgpack.unpackb(msgpack.packb(self.sender.plan(ws, version)))
        got = _threads([lambda: self.sender.send(ws, plan)]
                       + [lambda rx=rx: rx.receive(plan) for rx in self.rx])
        assert got[0] is None, got[0]
        return plan, got[1:]

    def close(self) -> None:
        self.sender.close()
        for rx in self.rx:
            rx.close()


@pytest.fixture
def group() -> Any:
    g = _Group()
    yield g
    g.close()


@pytest.mark.parametrize("frac", [0.02, 0.3])
def test_versions_arrive_bit_identical_and_smaller(group: _Group, frac: float) -> None:
    g = torch.Generator().manual_seed(3)
    ws = _weights(g)
    full = build_layout(ws, group.sender.bucket_bytes).total_bytes
    for version in range(1, 6):
        if version > 1:
            _step(ws, g, frac)
        plan, got = group.update(ws, version)
        assert (plan["base"] is None) == (version == 1)
        for received in got:
            assert received.version == version
            for name, t in ws.items():
                assert torch.equal(received.tensors[name].view(torch.uint8),
                                   t.view(torch.uint8)), name
        assert group.sender.last_full_bytes == full
        if version > 1:
            assert group.sender.last_sent_bytes < full
    assert group.sender.full_fallbacks == 0


def test_update_that_changes_every_byte_goes_whole(group: _Group) -> None:
    g = torch.Generator().manual_seed(7)
    ws = _weights(g)
    group.update(ws, 1)
    for name, t in ws.items():  # random bytes: no delta is smaller than the bucket
        if name != "head":
            t.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                    generator=g, dtype=torch.uint8))
    plan, got = group.update(ws, 2)
    assert plan["base"] is not None  # a delta update whose buckets all went FULL
    buckets = build_layout(ws, group.sender.bucket_bytes).buckets  # 7 x 2048 bytes + 128
    assert [size for _, size in buckets] == [2048] * 7 + [128]
    # the seven full ones go whole; the last holds 28 random bytes, the rest is padding
    sent = group.sender.last_sent_bytes
    assert 7 * (2048 + HEADER_BYTES) + HEADER_BYTES < sent <= 14464 + 8 * HEADER_BYTES
    for received in got:
        for name, t in ws.items():
            assert torch.equal(received.tensors[name].view(torch.uint8), t.view(torch.uint8))


def test_tied_weight_counted_once(group: _Group) -> None:
    ws = _weights(torch.Generator().manual_seed(0))
    once = sum(t.numel() * t.element_size() for n, t in ws.items() if n != "head")
    plan, got = group.update(ws, 1)
    assert [a for a, _ in plan["aliases"]] == ["head"]
    assert group.sender.last_sent_bytes == build_layout(ws, 2048).total_bytes
    assert group.sender.last_sent_bytes < once + 3 * 64  # only alignment on top
    assert torch.equal(got[0].tensors["head"], ws["emb"])


def test_tied_names_from_a_module() -> None:
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(5, 3)
    m.head = torch.nn.Linear(3, 5, bias=False)
    m.head.weight = m.emb.weight
    assert tied_names(m) == {"head.weight": "emb.weight"}
    meta = {k: v.to("meta") for k, v in m.state_dict().items()}
    assert build_layout(meta, 64, tied_names(m)).aliases == (("head.weight", "emb.weight"),)


def test_receiver_without_the_base_refuses_then_regroup_sends_full(group: _Group) -> None:
    g = torch.Generator().manual_seed(5)
    ws = _weights(g)
    group.update(ws, 1)
    group.rx[0]._held = "a-restarted-receiver"  # e.g. it lost its copy
    _step(ws, g, 0.05)
    plan = msgpack.unpackb(msgpack.packb(group.sender.plan(ws, 2)))
    got = _threads([lambda: group.sender.send(ws, plan)]
                   + [lambda rx=rx: rx.receive(plan) for rx in group.rx])
    assert got[0] is None
    assert isinstance(got[1], WeightSyncBaseMismatch) and "full update" in str(got[1])
    assert torch.equal(got[2].tensors["w"], ws["w"])
    group.connect()  # what the coordinator does after the failure: a new epoch
    _step(ws, g, 0.05)
    plan, got = group.update(ws, 3)
    assert plan["base"] is None and group.sender.full_fallbacks == 1
    for received in got:
        assert torch.equal(received.tensors["w"], ws["w"])


def test_corrupted_base_is_caught_by_the_checksum(group: _Group) -> None:
    g = torch.Generator().manual_seed(6)
    ws = _weights(g)
    group.update(ws, 1)
    assert group.rx[1]._staging is not None
    group.rx[1]._staging[5] ^= 1  # same id, different bytes
    _step(ws, g, 0.05)
    plan = msgpack.unpackb(msgpack.packb(group.sender.plan(ws, 2)))
    got = _threads([lambda: group.sender.send(ws, plan)]
                   + [lambda rx=rx: rx.receive(plan) for rx in group.rx])
    assert torch.equal(got[1].tensors["emb"], ws["emb"])
    assert isinstance(got[2], WeightSyncBaseMismatch) and "checksum" in str(got[2])
