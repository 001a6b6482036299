"""A micro-batch's responses seen by the trained models: padded to the micro-batch's own
widths, or packed without padding.

Packed: the rows' real tokens (prompt, then response) are laid end to end in a few rows as
long as the longest sequence, position ids restarting at 0 for every sequence, and the
model is called without an attention mask or KV cache. Hugging Face models (transformers
>= 4.54: GPT-2, Llama, Qwen2, ... through `masking_utils.create_causal_mask`) read such
position ids as packed sequences and confine each token's attention to its own sequence
(a block-diagonal causal mask; flash-attention takes them as cu_seqlens). Compute goes to
padding only in packed rows' tails, and the LM head runs only where a response token is
predicted (`logits_to_keep` as a mask). Rows as long as the longest sequence, not one row
of everything: SDPA with a dense mask costs (row length)^2 per row.

Whether a model keeps packed sequences apart is not taken on trust: `packs` probes it once
per model class (two sequences packed vs. alone), so a model that would let sequences see
each other falls back to padding instead of training on a wrong loss.

Both views give, per response token, the numbers of `response_logits` / `response_values`
on the padded batch, to float rounding (tests/unit/rl/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from rlhf_async.modeling.models import (
    ScalarHeadModel,
    keep_logits,
    response_logits,
    response_values,
)
from rlhf_async.modeling.rollout import RolloutBatch, attention_mask

# transformers >= 5 keeps logits at a [rows, positions] bool mask (`logits_to_keep`)
MASK_KEEP = int(transformers.__version__.split(".")[0]) >= 5


class ResponseView(Protocol):
    """Inputs of one micro-batch laid out for a forward. `targets`: the response tokens
    the logits predict, in the view's layout; `restore` maps a per-target tensor back to
    the micro-batch's [b, R] (zeros where no token is)."""

    targets: Tensor

    def logits(self, actor: nn.Module) -> Tensor: ...

    def values(self, critic: nn.Module) -> Tensor: ...

    def restore(self, x: Tensor) -> Tensor: ...


@dataclass
class PaddedView:
    """Left-padded prompts [b, P'] and right-padded responses [b, R'] (trimmed to the
    micro-batch's longest prompt and response, or as given); `width` = the batch's R."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    targets: Tensor  # [b, R'] the response ids
    response_mask: Tensor
    width: int

    def _args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.prompt_ids, self.prompt_mask, self.targets, self.response_mask

    def logits(self, actor: nn.Module) -> Tensor:  # [b, R', V]
        return response_logits(actor, *self._args())

    def values(self, critic: nn.Module) -> Tensor:  # [b, R']
        critic_fwd: Any = critic  # a ScalarHeadModel, or an engine wrapping one
        return response_values(critic_fwd, *self._args())

    def restore(self, x: Tensor) -> Tensor:  # [b, R'] -> [b, R]
        return F.pad(x, (0, self.width - x.shape[1]))


def padded_view(mb: RolloutBatch, trim: bool) -> PaddedView:
    """`mb` as it is, or (`trim`) without the prompt columns no row uses (left padding)
    and the response columns after the last real token of any row (right padding)."""
    pm, rm, R = mb.prompt_mask, mb.response_mask, mb.response_ids.shape[1]
    p0, r1 = 0, R
    if trim and len(mb):
        p0 = pm.shape[1] - max(int(pm.sum(dim=1).max()), 1)
        r1 = max(int(response_widths(rm).max()), 1)
    return PaddedView(mb.prompt_ids[:, p0:], pm[:, p0:], mb.response_ids[:, :r1],
                      rm[:, :r1], R)


def response_widths(response_mask: Tensor) -> Tensor:
    """[B, R] -> [B]: columns up to and including each row's last real token."""
    R = response_mask.shape[1]
    cols = torch.arange(1, R + 1, device=response_mask.device)
    return (attention_mask(response_mask) * cols).amax(dim=1)


@dataclass
class PackedView:
    """The rows' real tokens packed into k rows of C (the longest sequence's length):
    input_ids and position_ids [k, C] (a row's unused tail is one more sequence, never
    read); `keep` [k, C] bool: the positions whose output predicts (or values the state
    before) a response token, `targets` [1, n] those tokens in row-major order of `keep`;
    `rows`, `cols` [n]: where each sits in the micro-batch's [b, R]; `last`: (packed row,
    column) [b] each, of every sequence's last real token (a reward model's score)."""

    input_ids: Tensor
    position_ids: Tensor
    keep: Tensor
    targets: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]
    last: tuple[Tensor, Tensor]

    def logits(self, actor: nn.Module) -> Tensor:  # [1, n, V]
        kw = {"input_ids": self.input_ids, "position_ids": self.position_ids,
              "use_cache": False}
        if keep_logits(actor, 1) and MASK_KEEP:  # the LM head only at the kept positions
            out = actor(**kw, logits_to_keep=self.keep).logits  # [n, V]
        else:
            out = actor(**kw).logits[self.keep]
        return out.reshape(1, self.targets.shape[1], -1)

    def values(self, critic: nn.Module) -> Tensor:  # [1, n]
        return critic(self.input_ids, None, self.position_ids)[self.keep][None]

    def restore(self, x: Tensor) -> Tensor:  # [1, n] -> [b, R]
        out = x.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), x.reshape(-1))


def packed_view(mb: RolloutBatch) -> PackedView:
    """`mb`'s rows packed (see the module), first-fit longest first into rows as long as
    the longest sequence: attention computes a dense mask per packed row, so one row of
    every token would cost (sum of lengths)^2 where rows of the longest one cost about
    (sum of lengths) x (longest). Every row needs a prompt token: the logit of a
    response's first token is read at its prompt's last one."""
    pm = mb.prompt_mask.bool()
    if not bool(pm.any(dim=1).all()):
        raise ValueError("packing needs at least one prompt token in every row")
    resp = attention_mask(mb.response_mask).bool()  # [b, R]
    real = torch.cat([pm, resp], dim=1)  # [b, P + R]
    lengths = real.sum(dim=1)  # [b]
    C = int(lengths.max())
    slot, start, used = _first_fit(lengths.tolist(), C)
    pos = real.long().cumsum(dim=1) - 1  # [b, P + R] each token's position in its sequence
    row_of = torch.tensor(slot, device=real.device)[:, None].expand_as(real)
    col_of = torch.tensor(start, device=real.device)[:, None] + pos  # [b, P + R]
    k = len(used)
    cols = torch.arange(C, device=real.device)
    tail = torch.tensor(used, device=real.device)[:, None]  # [k, 1]
    position_ids = torch.where(cols < tail, 0, cols - tail)  # a tail restarts at 0
    ids = torch.cat([mb.prompt_ids, mb.response_ids], dim=1)
    # tails hold a real token, not the pad id (HF warns of padding without a mask)
    input_ids = ids[real][0].expand(k, C).clone()
    at = (row_of[real], col_of[real])
    input_ids[at] = ids[real]
    position_ids = position_ids.index_put(at, pos[real])
    P = pm.shape[1]
    before = (row_of[:, P:][resp], col_of[:, P:][resp] - 1)  # [n] each: the token before
    keep = torch.zeros(k, C, dtype=torch.bool, device=real.device)
    keep[before] = True
    order = (before[0] * C + before[1]).argsort()  # `keep`'s row-major order
    rows, rcols = (t[order] for t in resp.nonzero(as_tuple=True))
    last = (torch.tensor(slot, device=real.device),
             torch.tensor(start, device=real.device) + lengths - 1)
    return PackedView(input_ids, position_ids, keep, mb.response_ids[rows, rcols][None],
                      rows, rcols, (len(mb), mb.response_ids.shape[1]), last)


def _first_fit(lengths: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """Sequences into rows of `capacity`, longest first, each into the first row with
    room. -> each sequence's row and start column, each row's used length."""
    slot, start = [0] * len(lengths), [0] * len(lengths)
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((j for j, u in enumerate(used) if u + lengths[i] <= capacity), len(used))
        if j == len(used):
            used.append(0)
        slot[i], start[i] = j, used[j]
        used[j] += lengths[i]
    return slot, start, used


_PACKS: dict[tuple[type, str], bool] = {}


def packs(model: nn.Module) -> bool:
    """Whether `model` (a causal LM or a ScalarHeadModel) keeps packed sequences apart:
    two sequences packed give each one's outputs alone, to float rounding. Probed once per
    (class, attention implementation), in eval mode without gradients."""
    config = getattr(model.trunk if isinstance(model, ScalarHeadModel) else model,
                     "config", None)
    key = (type(model), str(getattr(config, "_attn_implementation", None)))
    if key not in _PACKS:
        _PACKS[key] = _probe(model, int(getattr(config, "vocab_size", 2)))
    return _PACKS[key]


def _probe(model: nn.Module, vocab: int) -> bool:
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=device) % vocab
    pos = torch.tensor([[0, 1, 2, 0, 1]], device=device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = _outputs(model, ids, pos)
            alone = torch.cat([_outputs(model, ids[:, :3], pos[:, :3]),
                               _outputs(model, ids[:, 3:], pos[:, 3:])], dim=1)
    finally:
        model.train(was)
    # loose enough for TF32 / reduced-precision matmuls; a leak moves outputs by O(1)
    return together.shape == alone.shape and torch.allclose(together.float(), alone.float(),
                                                            rtol=1e-2, atol=1e-3)


def _outputs(model: nn.Module, ids: Tensor, pos: Tensor) -> Tensor:
    if isinstance(model, ScalarHeadModel):
        return model(ids, None, pos)
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits
