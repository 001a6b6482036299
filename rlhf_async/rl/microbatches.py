"""How a minibatch is cut into micro-batches for gradient accumulation.

`train.max_tokens_per_microbatch = 0`: by rows, `train.grad_accum` equal parts in batch
order, each padded to the whole batch's widths (as before this module).

`> 0`: by a token budget. The rows are sorted longest first (so long rows go together and
short ones are not padded to them) and cut greedily where the next row would take the
micro-batch over the budget, counted as the tokens its forward processes:

- packed (a model that keeps packed sequences apart, `modeling.packing.packs`, trained by
  the plain torch engine): the sum of the rows' real tokens (prompt + response);
- padded (any other model, or train.backend = deepspeed): rows x (longest prompt + longest
  response) of the micro-batch, which is padded to those widths only.

A row longer than the budget on its own gets a micro-batch of its own (a warning says so,
once): training goes on, only that micro-batch is over the budget.

Every loss is normalised by the minibatch's global token and sequence counts (rl/learner.py
`_loss`, rl/algorithms.py `aggregate`: every `loss_agg` is a sum over rows divided by a
minibatch-wide count), so however the rows are grouped the gradients add up to the same
update, to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlhf_async.config import TrainConfig
from rlhf_async.log import get_logger
from rlhf_async.modeling.collectives import all_gather_1d
from rlhf_async.modeling.determinism import keyed_order
from rlhf_async.modeling.packing import (
    ResponseView,
    packed_view,
    packs,
    padded_view,
    response_widths,
)
from rlhf_async.modeling.rollout import RolloutBatch, attention_mask

log = get_logger(component="microbatches")


def plan(prompt_lens: list[int], response_lens: list[int], budget: int,
         packed: bool) -> list[list[int]]:
    """Positions (into the given lists) of each micro-batch, longest rows first, each
    within `budget` tokens (see the module); a row over it alone."""
    order = sorted(range(len(prompt_lens)),
                   key=lambda k: (-(prompt_lens[k] + response_lens[k]), k))
    out: list[list[int]] = []
    cur: list[int] = []
    total = max_p = max_r = 0
    for k in order:
        p, r = prompt_lens[k], response_lens[k]
        # the tokens the micro-batch's forward would process with row k in it
        cost = total + p + r if packed else (len(cur) + 1) * (max(max_p, p) + max(max_r, r))
        if cur and cost > budget:
            out.append(cur)
            cur, total, max_p, max_r = [], 0, 0, 0
        cur.append(k)
        total, max_p, max_r = total + p + r, max(max_p, p), max(max_r, r)
    return out + ([cur] if cur else [])


class MicroBatcher:
    """The trainer's micro-batches and the view its models see of each (`train.*`)."""

    def __init__(self, train: TrainConfig, packed: bool) -> None:
        self.budget, self.grad_accum, self.packed = (train.max_tokens_per_microbatch,
                                                     train.grad_accum, packed)
        self._warned = False

    @classmethod
    def for_models(cls, train: TrainConfig, models: list[nn.Module]) -> MicroBatcher:
        """Packed when a budget is set, the engine is plain torch and every trained model
        packs (actor and critic alike: one plan serves both); else padded, said once."""
        if not train.max_tokens_per_microbatch:
            return cls(train, packed=False)
        why = None
        if train.backend != "torch":
            why = f"train.backend = {train.backend} (packing needs the torch engine)"
        else:
            unable = [type(m).__name__ for m in models if not packs(m)]
            if unable:
                why = f"{', '.join(unable)} cannot keep packed sequences apart"
        if why is not None:
            log.info("packing_off", reason=why, fallback="padded token-budget micro-batches",
                     max_tokens_per_microbatch=train.max_tokens_per_microbatch)
        return cls(train, packed=why is None)

    def split(self, b: RolloutBatch, idx: Tensor) -> list[Tensor]:
        """Rows `idx` of `b` (one minibatch) as micro-batches of row indices."""
        if not self.budget:
            return [i for i in idx.tensor_split(min(self.grad_accum, len(idx))) if len(i)]
        pl = b.prompt_mask[idx].sum(dim=1)
        rm = b.response_mask[idx]
        rl = attention_mask(rm).sum(dim=1) if self.packed else response_widths(rm)
        groups = plan(pl.tolist(), rl.tolist(), self.budget, self.packed)
        if not self._warned and any(len(g) == 1 and int(pl[g[0]] + rl[g[0]]) > self.budget
                                    for g in groups):
            self._warned = True
            log.warning("row_over_token_budget", longest=int((pl + rl).max()),
                        max_tokens_per_microbatch=self.budget,
                        note="such a row trains alone in a micro-batch over the budget")
        return [idx[torch.tensor(g, device=idx.device)] for g in groups]

    def whole(self, b: RolloutBatch) -> list[Tensor]:
        """Every row of `b`, for the no-grad forwards of the old policy: one part without a
        budget (as before), else the budget's micro-batches."""
        rows = torch.arange(len(b), device=b.prompt_ids.device)
        return self.split(b, rows) if self.budget else [rows]

    def view(self, mb: RolloutBatch) -> ResponseView:
        """How the models see micro-batch `mb`: packed, or padded to its own widths (to
        the batch's without a budget, as before)."""
        return packed_view(mb) if self.packed else padded_view(mb, trim=self.budget > 0)


def minibatch_rows(b: RolloutBatch, seed: int, epoch: int, minibatches: int) -> list[Tensor]:
    """Local row indices of each minibatch; the split is over the GLOBAL batch, keyed by
    (seed, step, epoch), so it does not depend on how samples are spread over ranks.
    One minibatch holds every row: no collective (every rank skips it alike)."""
    if minibatches == 1:
        return [torch.arange(len(b), device=b.sample_ids.device)]
    all_ids = all_gather_1d(b.sample_ids).tolist()
    order = keyed_order(seed, ("minibatch", b.step, epoch), all_ids)
    mb_of = {sid: i * minibatches // len(order) for i, sid in enumerate(order)}
    local = torch.tensor([mb_of[int(s)] for s in b.sample_ids], device=b.sample_ids.device)
    return [torch.nonzero(local == k).flatten() for k in range(minibatches)]
