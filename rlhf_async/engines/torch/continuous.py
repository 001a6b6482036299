"""Continuous batching: a finished row's slot takes the next waiting prompt at once.

`generation.sample` decodes a batch until its longest response ends, narrow for a long
tail, though a decode step costs about the same for 4 rows as for 64. A `ContinuousBatch`
keeps up to `slots` rows decoding: later chunks' prompts enter as rows end; a chunk is
handed back when its last row ends (`step`).

Layout. The rows share one KV cache whose columns are time: each decode step writes column
L of every row. A row admitted at column L has its prompt's KV right-aligned in [L - P, L)
of its slot, the columns before masked, and keeps its own positions (rotary and learned
position embeddings are applied before the cache), so where it sits changes nothing. A
finished row's slot is free until the next admission; free slots leave when the batch is
at most half full and no prompt waits. When the columns run out, each row's valid columns
are gathered right-aligned into the first ones (`_compact`): a row attends over at most
the longest prompt plus response and a few columns of slack. A row whose prompt starts
with tokens whose KV was kept (`prefix_kv`: an episode's earlier turns) has only the rest
prefilled on top of it (under the weights that computed it); it keeps its own KV at its end.

Sampling is `sample`'s (keyed uniforms per sample and position: a row's tokens do not
depend on its batch); each token records the weight version that sampled it. Needs our
preallocated cache and functional decode step (GPT-2, Llama, Qwen2, Mistral).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.engines.torch.prefix_kv import Prefix, prefill_after, row_prefix, suffix_after
from rlhf_async.modeling.compiled_decode import step_for
from rlhf_async.modeling.decode_step import PACK_MIN_STEPS, DecodeStep, decode_step
from rlhf_async.modeling.generation import (
    Generated,
    SamplingParams,
    completes_stop_string,
    inverse_cdf,
    prefill,
    scaled_logprobs,
    stop_window,
)
from rlhf_async.modeling.kv_cache import (
    add_rows,
    compact_columns,
    preallocated_cache,
    select_rows,
    set_buffers,
)
from rlhf_async.modeling.rollout import PromptBatch


@dataclass
class _Chunk:
    """A caller's batch of prompts: admitted row by row, handed back whole."""

    key: Any
    prompts: PromptBatch
    uniforms: Tensor  # [B, R] float64
    out: Generated
    limits: Tensor  # [B] long: tokens each row may sample (<= R)
    mins: Tensor  # [B] long: tokens before a stop may be sampled
    pasts: Sequence[Prefix | None]  # [B] KV kept for the start of each prompt
    keep: Callable[[int, Prefix], None] | None  # takes each ended row's KV (row, prefix)
    on_admit: Callable[[int, int], None] | None  # (row, tokens of kept KV it was admitted on)
    admitted: int = 0
    finished: int = 0

    def prompt(self, r: int) -> list[int]:
        """Row r's prompt without its padding."""
        return self.prompts.prompt_ids[r][self.prompts.prompt_mask[r] != 0].tolist()


class ContinuousBatch:
    """Rows of many chunks decoding in one batch of at most `slots` rows (see the module).
    Not thread-safe: one thread calls `add` and `step`."""

    # per slot (row of the batch), made by `_start`
    row: Tensor  # [b] the row's index in its chunk
    t: Tensor  # [b] tokens it has sampled
    pos: Tensor  # [b, 1] the position of its next input
    u: Tensor  # [b, R] float64 its uniforms
    limit: Tensor  # [b] tokens it may sample
    min_t: Tensor  # [b] tokens before its stops may be sampled
    logits: Tensor  # [b, V] its next token's
    lv: Tensor  # [b] the weight version that computed `logits`
    kv: Tensor  # [b] the weight version that computed all its KV, -1 when several did
    tokens: Tensor  # [b, R] its response so far, pad after
    logprobs: Tensor  # [b, R]
    versions: Tensor  # [b, R]
    mask: Tensor  # [b, C] 1 on the cache columns it attends to
    barred: Tensor  # the stop ids in the vocabulary (min_new_tokens)
    L: int  # cache columns in use
    C: int  # cache columns allocated

    def __init__(self, actor: nn.Module, params: SamplingParams, slots: int | None) -> None:
        if slots is not None and slots < 1:  # None: no cap (the caller caps what it sends)
            raise ValueError(f"continuous batching needs at least 1 slot, got {slots}")
        if params.episode is not None:
            raise ValueError("continuous batching samples single responses; multi-turn "
                             "episodes (task.env) run their own loop")
        if preallocated_cache(actor, 1) is None or decode_step(actor) is None:
            raise ValueError(f"continuous batching needs a GPT-2, Llama, Qwen2 or Mistral "
                             f"model with plain parameters (got {type(actor).__name__}): "
                             "set generation.continuous_batching = false")
        if params.stop_strings and params.decode is None:
            raise ValueError("SamplingParams.stop_strings needs SamplingParams.decode")
        self.actor, self.params, self.slots = actor, params, slots
        actor.eval()  # a generator's module: it samples, never trains (toggling costs ms)
        self.R = params.max_new_tokens
        # free slots before a prefill: one is a whole model call (2-3 ms at 2x64 on a CPU,
        # a decode step's worth) however few rows it admits
        self.admit_min = max(1, (slots or 0) // 4)
        # columns past the longest row before a compaction: every row attends over all the
        # columns, so few; each compaction is a copy of the cache
        self.slack = max(16, self.R // 4)
        self.waiting: deque[_Chunk] = deque()
        self.reload()
        self.stops = torch.tensor(params.stops, dtype=torch.long)
        self._empty()

    # --- what the caller sees -------------------------------------------------------------

    def add(self, key: Any, prompts: PromptBatch, uniforms: Tensor,
            limits: Tensor | None = None, mins: Tensor | None = None,
            pasts: Sequence[Prefix | None] | None = None,
            keep: Callable[[int, Prefix], None] | None = None,
            on_admit: Callable[[int, int], None] | None = None) -> None:
        """Queue a chunk's prompts [B, P] (left-padded), uniforms [B, R], and per row at most
        limits[b] tokens (R), no stop before mins[b] (params.min_new_tokens). pasts[b]: KV
        kept for prompt b's first tokens (`prefix_kv`; `on_admit(b, tokens)`: how many its
        admission used); `keep(b, prefix)` takes row b's KV when it ends."""
        B, R = len(prompts), self.R
        dev = prompts.prompt_ids.device
        out = Generated(torch.full((B, R), self.params.pad_id, dtype=torch.long, device=dev),
                        torch.zeros((B, R), dtype=torch.long, device=dev),
                        torch.zeros((B, R), dtype=torch.float32, device=dev),
                        torch.full((B, R), -1, dtype=torch.long, device=dev))
        limits = (torch.full((B,), R) if limits is None else limits.clamp(max=R)).long()
        mins = (torch.full((B,), self.params.min_new_tokens) if mins is None else mins).long()
        self.waiting.append(_Chunk(key, prompts, uniforms.to(dev), out, limits, mins,
                                   pasts or [None] * B, keep, on_admit))

    def cancel(self, key: Any) -> Generated | None:
        """Stop chunk `key`: its rows leave their slots, what they sampled kept, its waiting
        rows never start. Its responses; None when it is not here (ended, never came)."""
        chunk = next((c for c in self.waiting if c.key == key), None)
        if chunk is not None:
            self.waiting.remove(chunk)
        slots = [s for s, c in enumerate(self.owner) if c is not None and c.key == key]
        if slots:
            chunk = self.owner[slots[0]]
            self._finish(slots)
        if chunk is None:
            return None
        if self.cache is not None and not bool(self._occupied().any()) and not self.waiting:
            self._empty()
        return chunk.out

    @property
    def rows(self) -> int:
        """Rows decoding now."""
        return sum(c is not None for c in self.owner)

    @property
    def busy(self) -> bool:
        """Whether a row decodes or a prompt waits."""
        return bool(self.waiting) or self.rows > 0

    def reload(self) -> None:
        """The module's weights changed in place: remake the decode step (its packed copies)."""
        step = step_for(self.actor, PACK_MIN_STEPS)
        assert step is not None  # checked in __init__
        self.fast: DecodeStep = step

    @torch.no_grad()
    def step(self, version: int) -> list[tuple[Any, Generated]]:
        """Admit waiting prompts into free slots (prefilled by the weights of `version`),
        sample a token for every row (each records the version that computed its logits),
        feed the rows still going through those weights; the chunks whose last row ended."""
        self._admit(version)
        if not self.rows:
            return []
        return self._step(torch.tensor([c is not None for c in self.owner]), version)

    # --- one decode step ------------------------------------------------------------------

    def _step(self, occ: Tensor, version: int) -> list[tuple[Any, Generated]]:
        p = self.params
        idx = occ.nonzero().flatten().to(self.t.device)  # [n] the occupied slots
        t = self.t[idx]  # [n] tokens each has so far
        logp = scaled_logprobs(self.logits[idx], p, t < self.min_t[idx], self.barred)
        tok = inverse_cdf(logp, self.u[idx, t])  # [n]
        self.tokens[idx, t] = tok
        self.logprobs[idx, t] = logp.gather(1, tok[:, None]).squeeze(1)
        self.versions[idx, t] = self.lv[idx]  # the weights that computed its logits
        self.t[idx] = t = t + 1
        done = torch.isin(tok, self.stops) | (t >= self.limit[idx])
        if p.stop_strings and p.decode is not None:
            for i in (~done & (t > self.min_t[idx])).nonzero().flatten().tolist():
                s, n = int(idx[i]), int(t[i])
                ids = self.tokens[s, max(0, n - stop_window(p.stop_strings)): n].tolist()
                done[i] = completes_stop_string(ids, p.stop_strings, p.decode)
        handed = self._finish(idx[done].tolist(), keep=True)
        live = self._occupied()
        if not bool(live.any()):
            if not self.waiting:
                self._empty()  # nothing left: the next chunk starts a fresh cache
            return handed
        if not self.waiting and 2 * int(live.sum()) <= len(self.owner):
            live = self._shrink(live)
        if self.L == self.C:
            self._compact()
        # each slot feeds its newest token (a free one a pad, whose logits no one reads)
        newest = self.tokens.gather(1, (self.t - 1).clamp(min=0)[:, None]).squeeze(1)
        feed = torch.where(live, newest, p.pad_id)  # [b]
        L = self.L
        self.mask[:, L] = 1  # every row, free ones too, attends at least to this column
        self.logits = self.fast(feed, self.pos, self.mask[:, : L + 1], self.cache)
        self.lv.fill_(version)
        self.kv[live & (self.kv != version)] = -1  # its KV now from two weight versions
        self.L = L + 1
        self.mask[~live, L] = 0
        self.pos += live[:, None].long()
        return handed

    def _occupied(self) -> Tensor:
        """[b] bool: the slots holding a row."""
        return torch.tensor([c is not None for c in self.owner], dtype=torch.bool,
                            device=self.t.device)

    def _finish(self, slots: list[int], keep: bool = False) -> list[tuple[Any, Generated]]:
        """Copy the ended rows into their chunks and free their slots (with `keep`, their
        KV to their chunk's `keep`); the chunks whose last row that was."""
        handed = []
        for s in slots:
            chunk, r, n = self.owner[s], int(self.row[s]), int(self.t[s])
            assert chunk is not None
            if keep and chunk.keep is not None and int(self.kv[s]) >= 0:
                kept = row_prefix(self.cache, self.mask[s, : self.L] != 0, s, chunk.prompt(r),
                                  self.tokens[s, :n].tolist(), int(self.kv[s]))
                if kept is not None:
                    chunk.keep(r, kept)
            out = chunk.out
            out.response_ids[r] = self.tokens[s]
            out.response_mask[r, :n] = 1
            out.logprobs[r] = self.logprobs[s]
            out.token_versions[r] = self.versions[s]
            self.owner[s] = None
            self.mask[s] = 0
            chunk.finished += 1
            if chunk.finished == len(chunk.prompts):
                handed.append((chunk.key, out))
        return handed

    # --- admission ------------------------------------------------------------------------

    def _admit(self, version: int) -> None:
        """Prefill waiting prompts into the free slots (and new ones, up to `slots`): the
        rows with KV kept under these weights on top of it, the others in full (two calls
        rather than one padded to the longest whole prompt)."""
        take = self._admissible()
        after = [suffix_after(c.pasts[r], c.prompt(r), version) for c, r in take]
        for (c, r), a in zip(take, after, strict=True):
            if c.on_admit is not None:
                c.on_admit(r, 0 if a is None else len(a[0].tokens))
        if fresh := [x for x, rest in zip(take, after, strict=True) if rest is None]:
            ids, m = self._prompts(fresh)  # [k, P]
            pos = (m.cumsum(dim=1) - 1).clamp(min=0)
            new, logits, ours = prefill(self.actor, ids, m, pos, ids.shape[1])
            if not ours:
                raise RuntimeError("continuous batching: the model returned its own KV cache")
            self._place(fresh, new, logits, m, pos[:, -1], version)
        if kept := [(x, a) for x, a in zip(take, after, strict=True) if a is not None]:
            self._place([x for x, _ in kept], *prefill_after(
                self.actor, [a[0] for _, a in kept], [a[1] for _, a in kept],
                self.params.pad_id), version)

    def _admissible(self) -> list[tuple[_Chunk, int]]:
        """The waiting rows to admit now (chunk, row): none until enough slots are free."""
        free = sum(c is None for c in self.owner)
        if self.slots is not None:
            room = free + self.slots - len(self.owner)
            enough = room >= self.admit_min
        else:  # no cap: wait for a quarter of the rows decoding (or none decodes)
            room = sum(len(c.prompts) - c.admitted for c in self.waiting)
            enough = room >= max(1, self.rows // 4)
        if not enough and free < len(self.owner):
            return []  # a prefill is a model call: wait until it fills enough slots to pay
        take: list[tuple[_Chunk, int]] = []
        while self.waiting and len(take) < room:
            c = self.waiting[0]
            k = min(len(c.prompts) - c.admitted, room - len(take))
            take += [(c, r) for r in range(c.admitted, c.admitted + k)]
            c.admitted += k
            if c.admitted == len(c.prompts):
                self.waiting.popleft()
        return take

    def _place(self, take: list[tuple[_Chunk, int]], new: Any, logits: Tensor, m: Tensor,
               last: Tensor, version: int) -> None:
        """Rows `take` into free slots: their prefilled KV `new` [k, H, P, D] per layer
        right-aligned at the cache's newest columns, mask m [k, P], the position of their
        last prompt token `last` [k], their first logits [k, V]."""
        P = m.shape[1]
        if self.cache is None:
            self._start(new.layers[0].keys, logits, P)
        elif P > self.L:
            self._compact(min_length=P)
        free = [s for s, c in enumerate(self.owner) if c is None]
        slots = free[: len(take)] + self._grow(len(take) - len(free))
        s, L = torch.tensor(slots, device=self.t.device), self.L
        for main, layer in zip(self.cache.layers, new.layers, strict=True):
            main.key_buffer[s, :, L - P: L] = layer.keys
            main.value_buffer[s, :, L - P: L] = layer.values
        self.mask[s] = 0
        self.mask[s, L - P: L] = m
        self.pos[s] = last[:, None] + 1
        self.t[s] = 0
        self.u[s] = torch.stack([c.uniforms[r] for c, r in take])
        self.limit[s] = torch.stack([c.limits[r] for c, r in take]).to(s.device)
        self.min_t[s] = torch.stack([c.mins[r] for c, r in take]).to(s.device)
        self.logits[s] = logits
        self.lv[s] = self.kv[s] = version
        self.tokens[s], self.logprobs[s], self.versions[s] = self.params.pad_id, 0.0, -1
        for slot, (c, r) in zip(slots, take, strict=True):
            self.owner[slot] = c
            self.row[slot] = r

    def _prompts(self, take: list[tuple[_Chunk, int]]) -> tuple[Tensor, Tensor]:
        """The prompts of rows `take` as one left-padded batch [k, P] (ids, mask), without
        the columns that are padding in every row."""
        W = max(c.prompts.prompt_ids.shape[1] for c, _ in take)
        pad = torch.nn.functional.pad
        ids = torch.stack([pad(c.prompts.prompt_ids[r], (W - c.prompts.prompt_ids.shape[1], 0),
                               value=self.params.pad_id) for c, r in take])
        m = torch.stack([pad(c.prompts.prompt_mask[r], (W - c.prompts.prompt_mask.shape[1], 0))
                         for c, r in take]).long()
        first = int((m.sum(dim=0) > 0).nonzero()[0]) if bool(m.any()) else W - 1
        return ids[:, first:], m[:, first:]

    # --- the cache's rows and columns -----------------------------------------------------

    def _empty(self) -> None:
        """No rows, no cache."""
        self.cache: Any = None
        self.owner: list[_Chunk | None] = []
        self.L = self.C = 0

    def _start(self, keys: Tensor, logits: Tensor, P: int) -> None:
        """A cache with no rows yet, its columns for prompts of P tokens and responses."""
        dev = keys.device
        _, H, _, D = keys.shape
        self.L, self.C = P, P + self.R + self.slack
        self.cache = preallocated_cache(self.actor, self.C)
        for layer in self.cache.layers:
            layer.device, layer.is_initialized = dev, True
            set_buffers(layer, keys.new_zeros((0, H, self.C, D)),
                        keys.new_zeros((0, H, self.C, D)), self.L)
        R, V, long = self.R, logits.shape[-1], torch.long
        shapes = {"pos": ((1,), long), "u": ((R,), torch.float64), "logits": ((V,), logits.dtype),
                  "tokens": ((R,), long), "logprobs": ((R,), torch.float32),
                  "versions": ((R,), long), "mask": ((self.C,), long)}
        for name in self._ROWS:  # per slot; no slots yet
            shape, dtype = shapes.get(name, ((), long))
            setattr(self, name, torch.zeros((0, *shape), dtype=dtype, device=dev))
        self.stops = self.stops.to(dev)
        self.barred = self.stops[self.stops < V]

    _ROWS = ("row", "t", "pos", "u", "limit", "min_t", "logits", "lv", "kv", "tokens",
             "logprobs", "versions", "mask")

    def _grow(self, n: int) -> list[int]:
        """Add n free slots; their indices."""
        if n <= 0:
            return []
        b = len(self.owner)
        for name in self._ROWS:
            x = getattr(self, name)
            setattr(self, name, torch.cat([x, x.new_zeros((n, *x.shape[1:]))]))
        add_rows(self.cache, n, self.L)
        self.owner += [None] * n
        return list(range(b, b + n))

    def _shrink(self, live: Tensor) -> Tensor:
        """Drop the free slots (one index copy of the cache); the new `live` (all true)."""
        keep = live.nonzero().flatten()
        for name in self._ROWS:
            setattr(self, name, getattr(self, name)[keep])
        select_rows(self.cache, keep, self.L)
        self.owner = [self.owner[i] for i in keep.tolist()]
        return live[keep]

    def _compact(self, min_length: int = 0) -> None:
        """Gather every row's valid columns right-aligned into the first ones (at least
        `min_length` of them), with `slack` more after them."""
        self.mask, self.L, self.C = compact_columns(self.cache, self.mask[:, : self.L] != 0,
                                                    self.C, min_length, self.slack)
