"""The supervised stages before RL, as loops over batches: SFT (cross-entropy on the
response tokens only) and the reward model (Bradley-Terry on preference pairs).

The built-in task (`artefacts.py`) feeds them synthetic batches, `rlhf-async sft` / `rm`
(`user_data.py`, `job/stages.py`) the user's rows. A batch is prompts left-padded and
responses right-padded, the layout every model call here reads; a pair batch holds the
chosen responses first and the rejected ones after, each with its prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf_async.modeling.models import ScalarHeadModel, response_logits, sequence_scores
from rlhf_async.modeling.rollout import loss_mask
from rlhf_async.progress import Phase

# prompt ids [B, P] (left-padded), prompt mask, response ids [B, R] (right-padded), mask
Batch = tuple[Tensor, Tensor, Tensor, Tensor]


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Token lists as a Batch, each side padded to its longest."""
    P, R, B = max(map(len, prompts)), max(map(len, responses)), len(prompts)
    p_ids = torch.full((B, P), pad_id, dtype=torch.long)
    r_ids = torch.full((B, R), pad_id, dtype=torch.long)
    p_mask, r_mask = torch.zeros_like(p_ids), torch.zeros_like(r_ids)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p_ids[b, P - len(p):], p_mask[b, P - len(p):] = torch.tensor(p), 1
        r_ids[b, :len(r)], r_mask[b, :len(r)] = torch.tensor(r), 1
    return p_ids, p_mask, r_ids, r_mask


def sft_loss(actor: nn.Module, batch: Batch) -> Tensor:
    """Mean cross-entropy over real response tokens (prompt and padding masked out)."""
    p_ids, p_mask, r_ids, r_mask = batch
    logits = response_logits(actor, p_ids, p_mask, r_ids, r_mask)  # [B, R, V]
    per_tok = F.cross_entropy(logits.transpose(1, 2), r_ids, reduction="none")  # [B, R]
    m = loss_mask(r_mask)  # a demonstrated episode's environment tokens are not learned
    return (per_tok * m).sum() / m.sum()


def pair_scores(rm: ScalarHeadModel, batch: Batch) -> tuple[Tensor, Tensor]:
    """(scores of the chosen responses [N], of the rejected ones [N]) of a pair batch."""
    s = sequence_scores(rm, *batch)  # [2N]
    n = s.shape[0] // 2
    return s[:n], s[n:]


def bradley_terry_loss(rm: nn.Module, batch: Batch) -> Tensor:
    """-log sigmoid(r(chosen) - r(rejected)), the mean over pairs."""
    assert isinstance(rm, ScalarHeadModel)
    sc, sr = pair_scores(rm, batch)
    return -F.logsigmoid(sc - sr).mean()


def fit(model: nn.Module, loss_fn: Callable[[nn.Module, Batch], Tensor],
        batches: Callable[[int], Batch], steps: int, lr: float, phase: str, progress: bool,
        on_step: Callable[[int, float], None] | None = None) -> float:
    """`steps` AdamW steps (gradient norm clipped at 1) on `batches(step)`; the model is in
    eval mode after. -> the last step's loss (nan for no steps)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    bar = Phase(phase, steps, enabled=progress)
    for step in range(steps):
        loss = loss_fn(model, batches(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.update(1, loss=loss.item())
        if on_step is not None:
            on_step(step, loss.item())
    bar.close()
    model.eval()
    return loss.item()
