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


def _round_trip(prev: torch.Tensor, new: torch.Tensor) -> tuple[int, torch.Tensor]:
    kind, payload = delta.encode(prev, new)
    base = prev.clone()
    delta.decode(kind, payload, base)
    assert torch.equal(base, new)
    return kind, payload


def test_codes_by_hand() -> None:
    prev = torch.tensor([0, 0, 0, 0, 0, 0x7FFF, 0, 0], dtype=torch.int16)
    new = torch.tensor([1, -1, 0, 5, 0, -0x8000, 0x7FFF, -0x8000], dtype=torch.int16)
    code, listed = delta.step_codes(prev.view(torch.uint8), new.view(torch.uint8))
    # +1 / -1 / same / listed 5 / same / 0x7fff -> 0x8000 is +1 on the wrapped word /
    # the two extremes of the difference are listed
    assert code.tolist() == [2, 0, 1, 3, 1, 2, 3, 3]
    assert listed.tolist() == [5, 0x7FFF, -0x8000]
    packed = delta._pack_pairs(code)
    assert packed.tolist() == [2 | 0 << 2 | 1 << 4 | 3 << 6, 1 | 2 << 2 | 3 << 4 | 3 << 6]
    assert torch.equal(delta._unpack_pairs(packed, 8), code)
    _round_trip(prev.view(torch.uint8), new.view(torch.uint8))


def test_unchanged_bucket_is_almost_free() -> None:
    prev = torch.randn(1 << 16).to(torch.bfloat16).view(torch.uint8)
    kind, payload = _round_trip(prev, prev.clone())
    assert kind == delta.STEP and payload.numel() < prev.numel() / 500


def test_one_ulp_steps_cost_about_their_entropy() -> None:
    g = torch.Generator().manual_seed(2)
    prev = torch.randn(1 << 18, generator=g).to(torch.bfloat16)
    step = (torch.rand(prev.shape, generator=g) < 0.05).to(torch.int16)  # 5% move one ulp
    new = prev.view(torch.int16) + step * torch.where(torch.rand(prev.shape, generator=g) < 0.5,
                                                      1, -1).to(torch.int16)
    kind, payload = _round_trip(prev.view(torch.uint8), new.view(torch.uint8))
    # entropy of {95%, 2.5%, 2.5%} is 0.34 bits a word; deflate of 4 codes a byte ~0.5
    full = 2 * prev.numel()
    assert kind == delta.STEP and 0.34 / 16 * full < payload.numel() < 0.7 / 16 * full


@pytest.mark.parametrize("nbytes", [8198, 8200])
def test_everything_changed_falls_back_to_full(nbytes: int) -> None:
    g = torch.Generator().manual_seed(4)  # random bytes: no form can be smaller
    prev = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    new = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    kind, payload = _round_trip(prev, new)
    assert kind == delta.FULL and payload.data_ptr() == new.data_ptr()


def test_everything_one_ulp_up_is_still_a_small_delta() -> None:
    prev = torch.randn(4096).to(torch.float16)
    new = (prev.view(torch.int16) + 1).view(torch.uint8)
    kind, payload = _round_trip(prev.view(torch.uint8), new)
    assert kind == delta.STEP and payload.numel() < new.numel() / 50


def test_corrupt_payload_is_a_value_error() -> None:
    prev = torch.zeros(4096, dtype=torch.uint8)
    new = prev.clone()
    new[::64] = 1
    kind, payload = delta.encode(prev, new)
    assert kind == delta.STEP
    with pytest.raises(ValueError, match="corrupt step payload"):
        delta.decode(kind, payload[: payload.numel() // 2], prev.clone())
    with pytest.raises(ValueError, match="does not fit"):
        delta.decode(kind, payload, torch.zeros(8192, dtype=torch.uint8))


def test_checksum_sees_a_swapped_pair() -> None:
    a = torch.tensor([1, 0, 2, 0], dtype=torch.uint8)
    b = torch.tensor([2, 0, 1, 0], dtype=torch.uint8)
    assert delta.checksum(a) != delta.checksum(b)


def test_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown delta kind"):
        delta.decode(7, torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_round_trip_on_the_gpu_matches_the_cpu() -> None:
    g = torch.Generator().manual_seed(8)
    prev = torch.randn(1 << 16, generator=g).to(torch.bfloat16)
    new = prev.view(torch.int16) + (torch.rand(prev.shape, generator=g) < 0.05).to(torch.int16)
    new[::97] += 300  # some listed words
    cpu = delta.encode(prev.view(torch.uint8), new.view(torch.uint8))
    gpu = delta.encode(prev.view(torch.uint8).cuda(), new.view(torch.uint8).cuda())
    assert gpu[0] == cpu[0] == delta.STEP and torch.equal(gpu[1], cpu[1])
    base = prev.view(torch.uint8).cuda()
    delta.decode(gpu[0], gpu[1].cuda(), base)
    assert torch.equal(base.cpu(), new.view(torch.uint8))
