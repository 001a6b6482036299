"""Kept KV across requests: a multi-turn episode's next turn prefills only its new tokens.

Each policy turn of an episode is a request whose prompt is the whole conversation so far,
so without this every turn prefills every earlier turn again. When a row of a
`ContinuousBatch` ends, the valid columns of its cache (its prompt and the response tokens
fed back, positions 0..n-1 in order) are a `Prefix`: the keys and values of exactly those
tokens under the weights of one version. A later prompt that starts with those tokens
needs only the rest prefilled on top of them (`prefill_after`); the result is what a full
prefill computes, to float rounding (the kept columns of the response came from decode
steps, the full prefill's from one pass).

KV is only ever reused under the weights that computed it: a row whose decode crossed a
weight commit (partial rollouts) keeps nothing, and a prefix of another version is never
used (its prompt is prefilled in full). `PrefixStore` holds the prefixes by the requests'
cache salt, least recently used first out beyond a byte budget.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.modeling.kv_cache import preallocated_cache
from rlhf_async.modeling.models import cache_keyword, keep_logits, output_cache


@dataclass(frozen=True)
class Prefix:
    """The KV of `tokens` (positions 0..n-1): per layer keys and values [H, n, D],
    computed by the weights of `version`."""

    tokens: tuple[int, ...]
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def row_prefix(cache: Any, valid: Tensor, slot: int, prompt: list[int], response: list[int],
               version: int) -> Prefix | None:
    """The prefix a batch row leaves when it ends: the `valid` [C] cache columns of slot
    `slot`, copied out; they hold its prompt and every response token but the last (never
    fed). None when they do not add up (nothing kept)."""
    tokens = (*prompt, *response[:-1])
    cols = valid.nonzero().flatten()
    if len(cols) != len(tokens) or not tokens:
        return None
    keys = tuple(layer.key_buffer[slot][:, cols] for layer in cache.layers)  # [H, n, D] each
    values = tuple(layer.value_buffer[slot][:, cols] for layer in cache.layers)
    return Prefix(tokens, keys, values, version)


def suffix_after(past: Prefix | None, prompt: list[int], version: int,
                 ) -> tuple[Prefix, list[int]] | None:
    """(`past`, the tokens of `prompt` to prefill after it); None (prefill it all) unless
    the prompt starts with the past's tokens, has more, and `version`'s weights computed
    the past."""
    if past is None or past.version != version:
        return None
    n = len(past.tokens)
    if n >= len(prompt) or tuple(prompt[:n]) != past.tokens:
        return None
    return past, prompt[n:]


@torch.no_grad()
def prefill_after(actor: nn.Module, pasts: list[Prefix], ids: list[list[int]], pad_id: int,
                  ) -> tuple[Any, Tensor, Tensor, Tensor]:
    """Prefill the tokens `ids[i]` after the KV of `pasts[i]` (one forward for the rows).

    The rows' pasts sit right-aligned in the first Np columns, their new tokens left-padded
    in the S after them. Returns (the cache [k, H, Np + S, D] per layer, each row's next
    logits [k, V], its attention mask over those columns [k, Np + S], the position of its
    last token [k])."""
    k = len(pasts)
    n = [len(p.tokens) for p in pasts]
    Np, S = max(n), max(len(x) for x in ids)
    cache = preallocated_cache(actor, Np + S)
    if cache is None:
        raise RuntimeError("prefill after kept KV needs our preallocated cache")
    dev = pasts[0].keys[0].device
    mask = torch.zeros((k, Np + S), dtype=torch.long, device=dev)
    for j, layer in enumerate(cache.layers):
        H, _, D = pasts[0].keys[j].shape
        keys = pasts[0].keys[j].new_zeros((k, H, Np, D))
        values = keys.clone()
        for i, p in enumerate(pasts):
            keys[i, :, Np - n[i]:] = p.keys[j]
            values[i, :, Np - n[i]:] = p.values[j]
        layer.update(keys, values)
    new = torch.full((k, S), pad_id, dtype=torch.long, device=dev)  # [k, S] left-padded
    for i, x in enumerate(ids):
        mask[i, Np - n[i]: Np] = 1
        if x:
            new[i, S - len(x):] = torch.tensor(x, dtype=torch.long, device=dev)
            mask[i, Np + S - len(x):] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [k, Np + S]
    out = actor(input_ids=new, attention_mask=mask, position_ids=pos[:, Np:], use_cache=True,
                **keep_logits(actor, 1), **{cache_keyword(actor): cache})
    if output_cache(out) is not cache:
        raise RuntimeError("prefill after kept KV: the model returned its own KV cache")
    return cache, out.logits[:, -1], mask, pos[:, -1]


class PrefixStore:
    """Kept prefixes by cache salt, least recently used out first beyond `budget` bytes
    (0: keep nothing). A prefix stays after `take`: the samples of a group often say the
    same first turn (the same tool call), and each of their next turns reuses it."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self.hits = self.misses = self.reused_tokens = 0
        self._lru: OrderedDict[tuple[str, tuple[int, ...]], Prefix] = OrderedDict()
        # salt -> how many of its prefixes have each length: a lookup tries each length once
        self._lengths: dict[str, Counter[int]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, salt: str, prefix: Prefix) -> None:
        if prefix.nbytes > self.budget:
            return
        self._pop((salt, prefix.tokens))
        self._lru[salt, prefix.tokens] = prefix
        self._lengths.setdefault(salt, Counter())[len(prefix.tokens)] += 1
        self.nbytes += prefix.nbytes
        while self.nbytes > self.budget:
            self._pop(next(iter(self._lru)))

    def take(self, salt: str, prompt: tuple[int, ...], version: int) -> Prefix | None:
        """The longest kept prefix under `salt` that `prompt` starts with, computed by the
        weights of `version`, cut to leave the prompt's last token to prefill (its logits
        are the first response token's); None when there is none."""
        p = None
        for length in sorted(self._lengths.get(salt, ()), reverse=True):  # longest first
            p = self._lru.get((salt, prompt[:length])) if length <= len(prompt) else None
            if p is not None and p.version == version:
                break
            p = None
        n = 0 if p is None else min(len(p.tokens), len(prompt) - 1)
        if p is None or n < 1:
            self.misses += 1
            return None
        self._lru.move_to_end((salt, p.tokens))
        self.hits += 1
        self.reused_tokens += n
        if n == len(p.tokens):
            return p
        return Prefix(p.tokens[:n], tuple(t[:, :n] for t in p.keys),
                      tuple(t[:, :n] for t in p.values), p.version)

    def drop_other_versions(self, version: int) -> None:
        """Free what the weights of `version` can never reuse (after a commit)."""
        for key in [k for k, p in self._lru.items() if p.version != version]:
            self._pop(key)

    def _pop(self, key: tuple[str, tuple[int, ...]]) -> Prefix | None:
        p = self._lru.pop(key, None)
        if p is not None:
            self.nbytes -= p.nbytes
            lengths, n = self._lengths[key[0]], len(key[1])
            lengths[n] -= 1
            if not lengths[n]:
                del lengths[n]
            if not lengths:
                del self._lengths[key[0]]
        return p
