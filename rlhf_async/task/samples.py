"""RUN_DIR/samples.jsonl: what a step trained on, as text (`run.log_samples` per step).

One line per step: `{"step": s, "samples": [{"prompt", "response", "reward", "advantage",
"hidden_score", "version", "sample_id", "group_id", "response_length"}, ...]}` (and, for a
multi-turn episode, "turns": each run of prompt, policy and environment text with its
role), the first
`run.log_samples` rows of the step's batch (whole groups first, so a GRPO group's
responses sit side by side), decoded with the task's decoder (the built-in digits task, which has
no tokenizer, shows its texts: one character per token, `sort_digits.TOKEN_CHARS`, the
same texts its rule and a reward server read). Written by the process that trains: rank 0 of the
lock-step loop, trainer rank 0 under Separation. `ops/reporting.py` follows the file to
TensorBoard (text) and W&B (a table) like metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_async.metrics import MetricsWriter, truncate_jsonl
from rlhf_async.modeling.rollout import ENV, PAD, RolloutBatch
from rlhf_async.task import Task
from rlhf_async.task.sort_digits import tokens_text

SAMPLES_FILE = "samples.jsonl"


def _text(task: Task, ids: list[int]) -> str:
    decode = task.decode
    return decode(ids) if decode is not None else tokens_text(ids)


def sample_rows(batch: RolloutBatch, advantages: Tensor | None, task: Task, n: int,
                ) -> list[dict[str, Any]]:
    """The first `n` rows of a scored batch as text. `advantages`: [B', R] token advantages
    of the batch's first B' rows (this rank's shard), shown as their mean over the
    response; rows past them get None."""
    rows = []
    episodes = bool((batch.response_mask == ENV).any())
    turns = batch.turns(lambda ids: _text(task, ids)) if episodes else None
    for i in range(min(n, len(batch))):
        mask = batch.response_mask[i] != PAD
        policy = batch.loss_mask[i].bool()
        response = batch.response_ids[i][mask].tolist()
        if task.eos_id in response:  # the text stops at EOS, as the reward function saw it
            response = response[: response.index(task.eos_id)]
        adv = None
        if advantages is not None and i < len(advantages):
            adv = float(advantages[i][policy].float().mean()) if policy.any() else 0.0
        row: dict[str, Any] = {
            "sample_id": int(batch.sample_ids[i]), "group_id": int(batch.group_ids[i]),
            "prompt": _text(task, batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()),
            "response": _text(task, response),
            "reward": None if batch.rewards is None else float(batch.rewards[i]),
            "hidden_score": None if batch.hidden_scores is None
            else float(batch.hidden_scores[i]),
            "advantage": adv, "version": batch.version,
            "response_length": int(policy.sum())}
        if turns is not None:
            row["turns"] = turns[i]
        rows.append(row)
    return rows


class SamplesLog:
    """Appends each step's sample rows to RUN_DIR/samples.jsonl; a run continuing from the
    checkpoint of `start_step` first drops the lines of the steps it trains again."""

    def __init__(self, run_dir: Path, count: int, task: Task, start_step: int) -> None:
        self.count, self.task = count, task
        path = run_dir / SAMPLES_FILE
        truncate_jsonl(path, start_step)
        self.writer = MetricsWriter(path) if count else None

    def write(self, step: int, batch: RolloutBatch, advantages: Tensor | None) -> None:
        if self.writer is not None:
            head = batch.select(torch.arange(min(self.count, len(batch)))).to("cpu")
            self.writer.write({"step": step, "samples": sample_rows(
                head, None if advantages is None else advantages[: len(head)].cpu(),
                self.task, self.count)})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
