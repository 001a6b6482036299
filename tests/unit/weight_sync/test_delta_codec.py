"""The delta codec: bit-exact against the full bytes, the smallest form chosen, full as the
fallback when nothing would be saved."""

from __future__ import annotations

import pytest
import torch

from rlhf_async.weight_sync import delta


def _step(t: torch.Tensor, frac: float, g: torch.Generator, scale: float) -> torch.Tensor:
    """A small AdamW-like step touching about `frac` of the values."""
    hit = torch.rand(t.shape, generator=g) < frac
    bump = (torch.randn(t.shape, generator=g) * scale).to(t.dtype)
    return torch.where(hit, t + bump * t.abs().clamp_min(1e-3), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.2, 0.9])
@pytest.mark.parametrize("scale", [3e-2, 4e-3])  # the smaller: mostly one ulp (STEP form)
def test_round_trip_is_bit_identical_over_versions(dtype: torch.dtype, frac: float,
                                                   scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3001, generator=g).to(dtype)
    held = w.clone()  # the receiver's copy
    for _ in range(4):
        new = _step(w, frac, g, scale)
        prev = torch.cat([w.view(torch.uint8), torch.zeros(62, dtype=torch.uint8)])
        nxt = torch.cat([new.view(torch.uint8), torch.zeros(62, dtype=torch.uint8)])
        kind, payload = delta.encode(prev, nxt)
        base = torch.cat([held.view(torch.uint8), torch.zeros(62, dtype=torch.uint8)])
        delta.decode(kind, payload, base)
        assert torch.equal(base, nxt)
        assert delta.checksum(base) == delta.checksum(nxt)
        held = base[: new.numel() * new.element_size()].view(dtype).clone()
        w = new


def test_form_chosen_by_size() -> None:
    n = 1 << 16
    prev = torch.zeros(n, dtype=torch.uint8)
    same = prev.clone()
    kind, payload = delta.encode(prev, same)
    assert kind == delta.GAPS and payload.numel() == 3 * (n // 2 // 255)  # only the grid
    dense = prev.clone()
    dense[::8] = 7  # every 4th word changed by 7: a bit per word beats 3 bytes a word
    kind, payload = delta.encode(prev, dense)
    assert kind == delta.MASK and payload.numel() == n // 2 // 8 + 2 * (n // 8)
    ulps = prev.clone()
    ulps[::4] = 1  # every other word one unit up
    ulps[2::8] = 255  # and every 4th word one down (0x00ff -> wraps in the low byte)
    ulps[3::8] = 255  # (0xffff = -1)
    kind, payload = delta.encode(prev, ulps)
    assert kind == delta.STEP and payload.numel() == n // 2 // 4
    base = prev.clone()
    delta.decode(kind, payload, base)
    assert torch.equal(base, ulps)
    everything = torch.ones(n, dtype=torch.uint8)
    kind, payload = delta.encode(prev, everything)
    assert kind == delta.FULL and payload.numel() == n


def test_checksum_sees_a_swapped_pair() -> None:
    a = torch.tensor([1, 0, 2, 0], dtype=torch.uint8)
    b = torch.tensor([2, 0, 1, 0], dtype=torch.uint8)
    assert delta.checksum(a) != delta.checksum(b)


def test_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown delta kind"):
        delta.decode(7, torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
