"""A KV cache allocated once per generation call, for our sampling loop.

HF's DynamicCache grows every layer's keys and values by `torch.cat` at each new token,
copying the whole cache each time (quadratic in the response length; 11% of the
generate phase in bench/README.md). `preallocated_cache` gives the model a DynamicCache
whose layers write each new position into buffers sized for the whole prompt + response
once, and hand attention a view of the filled part: the same keys and values, the same
attention length, no copy. Rows that finished their response are dropped from it with
`batch_select_indices`, as from HF's own cache.

Only for models whose cache is plain full-attention layers (GPT-2, Llama, Qwen2, ...):
sliding-window and hybrid caches, and transformers without cache layers, keep the
model's own cache (`preallocated_cache` returns None).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

try:  # cache layer objects: transformers >= 4.56
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - older transformers: the model's own cache
    DynamicCache = None  # type: ignore[assignment,misc]
    DynamicLayer = object  # type: ignore[assignment,misc]


class BufferLayer(DynamicLayer):
    """One attention layer's keys and values [B, H, T, D]: views of the first T positions
    of buffers of `capacity` positions, allocated at the first update."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.key_buffer = self.value_buffer = torch.empty(0)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        B, H, _, _ = key_states.shape
        self.key_buffer = key_states.new_empty((B, H, self.capacity, key_states.shape[-1]))
        self.value_buffer = value_states.new_empty((B, H, self.capacity,
                                                    value_states.shape[-1]))
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions, allocated for {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if not self.is_initialized:
            return
        length = self.get_seq_length()
        self.key_buffer = self.key_buffer[indices]
        self.value_buffer = self.value_buffer[indices]
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]


def preallocated_cache(model: nn.Module, capacity: int) -> Any | None:
    """A DynamicCache for `model` whose layers hold `capacity` positions without growing;
    None where the model's cache is not plain full-attention layers (see the module)."""
    config = getattr(getattr(model, "module", model), "config", None)  # a wrapper's model's
    if DynamicCache is None or not isinstance(config, PretrainedConfig):
        return None
    try:
        cache = DynamicCache(config=config)
    except (TypeError, ValueError, KeyError):  # a config the layer dispatch cannot read
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [BufferLayer(capacity) for _ in cache.layers]
    return cache


# --- a batch's cache as rows and columns (continuous batching) ---------------------------


def set_buffers(layer: Any, keys: Tensor, values: Tensor, length: int) -> None:
    """A cache layer over buffers [b, H, C, D], of which the first `length` columns filled."""
    layer.key_buffer, layer.value_buffer, layer.capacity = keys, values, keys.shape[2]
    layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]


def add_rows(cache: Any, n: int, length: int) -> None:
    """n more rows of zeros in every layer."""
    for layer in cache.layers:
        k, v = layer.key_buffer, layer.value_buffer
        set_buffers(layer, torch.cat([k, k.new_zeros((n, *k.shape[1:]))]),
                    torch.cat([v, v.new_zeros((n, *v.shape[1:]))]), length)


def select_rows(cache: Any, keep: Tensor, length: int) -> None:
    """Only rows `keep` [k] (one index copy of every layer)."""
    for layer in cache.layers:
        set_buffers(layer, layer.key_buffer[keep], layer.value_buffer[keep], length)


def compact_columns(cache: Any, valid: Tensor, capacity: int, min_length: int,
                    slack: int) -> tuple[Tensor, int, int]:
    """Gather every row's `valid` [b, L] columns right-aligned into the first ones (at
    least `min_length` of them), into buffers with `slack` columns more (at least
    `capacity`). Returns (the new mask [b, C2], its L2 filled columns, C2)."""
    b, L = valid.shape
    L2 = max(min_length, int(valid.sum(dim=1).max()) if b else 0)
    C2 = max(capacity, L2 + slack)
    # each row's columns, the masked ones first, the valid ones after them in order
    order = torch.sort(valid.int(), dim=1, stable=True).indices  # [b, L]
    if L2 <= L:
        src, keep = order[:, L - L2:], valid.gather(1, order[:, L - L2:])
    else:  # more columns than now: new masked ones in front
        src = torch.cat([order.new_zeros((b, L2 - L)), order], dim=1)
        keep = torch.cat([valid.new_zeros((b, L2 - L)), valid.gather(1, order)], dim=1)
    for layer in cache.layers:
        bufs = []
        for buf in (layer.key_buffer, layer.value_buffer):
            _, H, _, D = buf.shape
            new = buf.new_zeros((b, H, C2, D))
            new[:, :, :L2] = buf[:, :, :L].gather(2, src[:, None, :, None].expand(b, H, L2, D))
            bufs.append(new)
        set_buffers(layer, bufs[0], bufs[1], L2)
    mask = torch.zeros((b, C2), dtype=torch.long, device=valid.device)
    mask[:, :L2] = keep.long()
    return mask, L2, C2
