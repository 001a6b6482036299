"""samples.jsonl rows: the built-in task's samples are text, one character a token."""

from __future__ import annotations

import torch

from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.task.samples import sample_rows
from rlhf_async.task.sort_digits import BOS, EOS, FIRST_DIGIT, PAD, SEP, SortDigitsTask


def test_the_built_in_tasks_samples_are_text():
    d = [FIRST_DIGIT + x for x in (3, 1, 4)]
    prompt = torch.tensor([[PAD, BOS, *d, SEP]])
    response = torch.tensor([[d[1], d[0], d[2], EOS, PAD]])
    batch = RolloutBatch(prompt, (prompt != PAD).long(), response, (response != PAD).long(),
                         torch.zeros(1, 5), torch.tensor([7]), torch.tensor([3]),
                         rewards=torch.tensor([0.5]))
    task = SortDigitsTask.__new__(SortDigitsTask)  # its texts need no data
    [row] = sample_rows(batch, None, task, 1)
    assert row["prompt"] == "^314|" and row["response"] == "134"
    assert row["reward"] == 0.5 and row["sample_id"] == 7


def test_ids_past_the_tasks_own_show_as_numbers():
    assert SortDigitsTask.show([FIRST_DIGIT + 1, 40, EOS]) == "1<40>$"
