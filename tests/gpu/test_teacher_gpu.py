"""placement.teacher on a GPU: a teacher on a device other than its scorer's batch scores a
copy there, and its log-probs come back to the batch's device. Skips without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_async.rl.scoring import RewardMix, score
from tests.unit.rl.test_learner_by_hand import batch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_teacher_on_a_gpu_of_its_own():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    ref, teacher = GPT2LMHeadModel(cfg).eval(), GPT2LMHeadModel(cfg).eval()
    b = batch().replace(prompt_ids=torch.tensor([[1, 2], [3, 4]]),
                        prompt_mask=torch.ones(2, 2, dtype=torch.long))
    mix = RewardMix(rule=lambda p, r, m: torch.zeros(len(p)))
    beside = score(None, ref, b, 1.0, mix, teacher=teacher)
    apart = score(None, ref, b, 1.0, mix, teacher=copy.deepcopy(teacher).cuda())
    assert apart.teacher_logprobs.device == b.response_ids.device
    torch.testing.assert_close(apart.teacher_logprobs, beside.teacher_logprobs, rtol=1e-4,
                               atol=1e-5)
