"""One bucket of a delta update on the wire: a header, then the encoded payload.

Why a header per bucket: the payload's form and size depend on the data, which the plan
(made before anything is gathered) cannot know. The header is three int64 (kind, payload
bytes, checksum of the new bucket bytes), broadcast first so every receiver can size its
landing buffer; a FULL payload lands straight in the staging buffer.
"""

from __future__ import annotations

import torch

from rlhf_async.weight_sync.delta import FULL, checksum, decode, encode
from rlhf_async.weight_sync.group import BroadcastGroup

HEADER_BYTES = 3 * 8


def send_bucket(group: BroadcastGroup, data: torch.Tensor, prev: torch.Tensor,
                label: str) -> tuple[list[tuple[torch.distributed.Work, str]], int]:
    """Encode `data` (the new bucket bytes) against `prev` (this bucket's bytes of the
    base version, updated to `data` here), broadcast header and payload; returns the works
    (they own their tensors) and the bytes put on the wire."""
    kind, payload = encode(prev, data)
    header = torch.tensor([kind, payload.numel(), checksum(data)], dtype=torch.int64)
    # FULL: `data` may be a reused buffer or the live weights; STEP was deflated on the CPU
    payload = payload.clone() if kind == FULL else payload.to(data.device)
    prev.copy_(data)
    works = [(group.broadcast(header.to(data.device)), f"header of {label}"),
             (group.broadcast(payload), label)]
    return works, HEADER_BYTES + payload.numel()


def receive_bucket(group: BroadcastGroup, base: torch.Tensor, has_base: bool,
                   label: str) -> str | None:
    """Receive one encoded bucket into `base` (the staging bytes of this bucket, holding the
    previous version when `has_base`); returns a problem, or None when the bytes are exact."""
    header = torch.empty(3, dtype=torch.int64, device=base.device)
    group.wait(group.broadcast(header), f"header of {label}")
    kind, nbytes, check = (int(v) for v in header.cpu())
    if kind == FULL:
        if nbytes != base.numel():
            group.wait(group.broadcast(torch.empty(nbytes, dtype=torch.uint8,
                                                   device=base.device)), label)
            return f"{label}: full payload of {nbytes} bytes for a {base.numel()}-byte bucket"
        group.wait(group.broadcast(base), label)
    else:
        payload = torch.empty(nbytes, dtype=torch.uint8, device=base.device)
        group.wait(group.broadcast(payload), label)
        if not has_base:
            return None  # the caller reports the missing base once
        try:
            decode(kind, payload, base)
        except (ValueError, IndexError, RuntimeError) as exc:
            return f"{label}: undecodable delta ({exc})"
    if has_base and checksum(base) != check:
        return f"{label}: checksum differs after applying the delta"
    return None
