"""What prefilling cost (KV reused from a prefix cache across an episode's turns) travels
with the rollout and is counted in the step's metrics record, like the other generation
metrics."""

from __future__ import annotations

from dataclasses import fields

import torch

from rlhf_async.engines import Completion, Prefill
from rlhf_async.engines.requests import PrefillTally, assemble
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.rollout import POLICY, PREFILL_COUNTS, PromptBatch, RolloutBatch
from rlhf_async.rl.step_stats import global_stats


def _batch(B: int, **extra) -> RolloutBatch:
    return RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                        torch.ones(B, 3, dtype=torch.long), torch.full((B, 3), POLICY),
                        torch.zeros(B, 3), torch.arange(B), torch.arange(B),
                        rewards=torch.zeros(B), **extra)


def test_a_prefill_is_added_over_requests():
    assert [f.name for f in fields(Prefill)] == ["prefilled", "reused", "hits", "misses"]
    assert len(PREFILL_COUNTS) == len(fields(Prefill))  # the rollout's columns, in order
    first, second = Prefill.of(12, 0), Prefill.of(30, 25)
    assert first == Prefill(12, 0, 0, 1) and second == Prefill(5, 25, 1, 0)
    assert first + second == Prefill(17, 25, 1, 1)


def test_the_counts_travel_and_are_summed_in_the_step_record():
    counts = torch.tensor([[12, 0, 0, 1], [17, 25, 1, 1], [8, 40, 2, 1], [5, 0, 0, 1]])
    b = _batch(4, prefill_counts=counts)
    again = RolloutBatch.from_tensors(b.to_tensors(), b.meta())  # over the wire
    assert again.prefill_counts is not None and torch.equal(again.prefill_counts, counts)
    both = RolloutBatch.concat([again.select(torch.tensor([0, 1])),
                                again.select(torch.tensor([2, 3]))])
    s = global_stats(both, torch.zeros(4, 3), torch.zeros(4, 3), {}, 1)
    # counts over the step's rows, not means: 42 prompt tokens prefilled, 65 reused
    assert {k: v for k, v in s.items() if k.startswith("kv/")} == {
        "kv/prefilled_tokens": 42.0, "kv/reused_tokens": 65.0, "kv/hits": 3.0,
        "kv/misses": 4.0, "kv/reused_frac": 65 / 107}
    assert not any(k.startswith("kv/") for k in global_stats(
        _batch(4), torch.zeros(4, 3), torch.zeros(4, 3), {}, 1))  # no engine: no counts


def test_rollouts_from_completions_and_episodes_carry_each_rows_counts():
    params = SamplingParams(max_new_tokens=3, eos_id=3, pad_id=0)
    prompts = PromptBatch(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                          torch.tensor([7, 9]), torch.tensor([0, 0]))
    done = [Completion("a", [4], [-0.5], [0], "stop", Prefill.of(2, 0)),
            Completion("b", [5, 6], [-0.1, -0.2], [0, 0], "length", Prefill.of(2, 1))]
    b = assemble(prompts, done, params, step=0, version=0, partial=False)
    assert b.prefill_counts is not None
    assert b.prefill_counts.tolist() == [[2, 0, 0, 1], [1, 1, 1, 0]]
    tally = PrefillTally()  # an episode per sample id, turn by turn (rows in any order)
    tally.add([9, 7], [Completion("t0", prefill=Prefill.of(4, 0)),
                       Completion("t0", prefill=Prefill.of(3, 0))])
    tally.add([9], [Completion("t1", prefill=Prefill.of(10, 6))])
    counted = tally.onto(b)
    assert counted.prefill_counts is not None
    assert counted.prefill_counts.tolist() == [[3, 0, 0, 1], [8, 6, 1, 1]]
