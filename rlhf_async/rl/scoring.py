"""The scorer's role: rewards from the reward model (or the task's rule reward) and the
reference model's log-probs of each response."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhf_async.modeling.models import ScalarHeadModel, response_logits, sequence_scores
from rlhf_async.modeling.packing import packed_view, packs
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl import algorithms as A
from rlhf_async.rl.guards import require_finite

HiddenScore = Callable[[Tensor, Tensor, Tensor], Tensor]  # (prompt_ids, response_ids, mask)
# one thread runs a rule that waits on the network while the caller runs the forwards
_RULES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rule-reward")


@dataclass(frozen=True)
class RewardMix:
    """How a sample's reward is made: the reward model's score x `rm_weight`, plus the
    task's rule score x `rule_weight`; with no reward model, the rule's score alone; plus
    DAPO's overlong penalty (`A.overlong_penalty`, 0 = off) on responses ending within
    `overlong_buffer` tokens of `max_new_tokens`. The rule's score is reported as the
    hidden score; with no rule, the reward model's is. A NaN or infinite reward or hidden
    score stops the step (`NonFiniteError`, naming the samples).
    `overlap`: the rule mostly waits (a reward server), so `start` runs it in a thread while
    the caller runs the reference and reward-model forwards."""

    rule: HiddenScore | None
    rm_weight: float = 1.0
    rule_weight: float = 0.0
    overlap: bool = False
    overlong_penalty: float = 0.0
    overlong_buffer: int = 1
    max_new_tokens: int = 0
    unrewarded: bool = False  # distillation: with neither model nor rule, rewards are 0

    def __post_init__(self) -> None:
        if self.rule is None and self.rule_weight:
            raise ValueError("a rule weight needs a rule")

    def start(self, batch: RolloutBatch) -> Future[Tensor] | None:
        """The rule's scores of `batch` [B], on their way (with `overlap`; else None: then
        `combine` computes them itself). Give the future to `combine`."""
        if not self.overlap or self.rule is None:
            return None
        return _RULES.submit(self.rule, batch.prompt_ids, batch.response_ids,
                             batch.response_mask)

    def combine(self, rm_scores: Tensor | None, batch: RolloutBatch,
                started: Future[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """(rewards [B], hidden scores [B]) of `batch`, given its reward-model scores (and
        the rule's scores `start` began, if it did)."""
        rewards, hidden = self._mix(rm_scores, batch, started)
        for what, t in (("a reward", rewards), ("a hidden score", hidden)):
            require_finite(what, t, batch.step, "check the reward function / model",
                           batch.sample_ids)
        if self.overlong_penalty:  # the policy's tokens: tool output is not its length
            lengths = batch.loss_mask.sum(dim=1).to(rewards.device)
            rewards = rewards + A.overlong_penalty(lengths, self.max_new_tokens,
                                                   self.overlong_buffer, self.overlong_penalty)
        return rewards, hidden

    def _mix(self, rm_scores: Tensor | None, batch: RolloutBatch,
             started: Future[Tensor] | None) -> tuple[Tensor, Tensor]:
        hidden = None
        if batch.env_rewards is not None:  # an episode's environment judged it: its rule
            hidden = batch.env_rewards.float()
        elif started is not None:
            hidden = started.result()  # the rule's own error, raised here
        elif self.rule is not None:
            hidden = self.rule(batch.prompt_ids, batch.response_ids, batch.response_mask)
        if rm_scores is None:
            if hidden is None and self.unrewarded:
                zeros = torch.zeros(len(batch))
                return zeros, zeros.clone()
            if hidden is None:
                raise ValueError("rewards need a reward model or a rule reward")
            return hidden.clone(), hidden
        rm_scores = rm_scores.float()
        rewards = self.rm_weight * rm_scores
        if hidden is None:
            return rewards, rm_scores.clone()
        hidden = hidden.to(rewards.device)
        return (rewards + self.rule_weight * hidden if self.rule_weight else rewards), hidden


@torch.no_grad()
def score(reward_model: ScalarHeadModel | None, reference: nn.Module, batch: RolloutBatch,
          temperature: float, mix: RewardMix, packed: bool = False,
          teacher: nn.Module | None = None) -> RolloutBatch:
    """Add rewards [B], reference log-probs [B, R] and hidden scores [B] (see RewardMix),
    and with a distillation `teacher` its log-probs [B, R] as the reference's; a teacher on
    another device than the batch (`placement.teacher`) scores a copy of it there.
    `packed` (with `train.max_tokens_per_microbatch`): the forwards run on the rows' real
    tokens packed end to end (`modeling/packing.py`) where both models keep packed
    sequences apart, not on rows padded to the longest: the same numbers to float
    rounding, without the padding's compute on a long tail of lengths."""
    started = mix.start(batch)  # a reward server's answer comes while the forwards run
    home = batch.response_ids.device
    apart = teacher is not None and _device(teacher) != home
    lms = [reference] if teacher is None or apart else [reference, teacher]
    lps, rm = _forwards(lms, reward_model, batch, temperature, packed)
    if teacher is not None and apart:
        there = batch.to(_device(teacher))
        lps += [lp.to(home) for lp in _forwards([teacher], None, there, temperature, packed)[0]]
    ref_lp = lps[0]
    rewards, hidden = mix.combine(rm, batch, started)
    return batch.replace(rewards=rewards.to(ref_lp.device), ref_logprobs=ref_lp,
                         hidden_scores=hidden.to(ref_lp.device),
                         teacher_logprobs=None if teacher is None else lps[1])


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forwards(lms: list[nn.Module], reward_model: ScalarHeadModel | None,
              batch: RolloutBatch, temperature: float, packed: bool
              ) -> tuple[list[Tensor], Tensor | None]:
    """Each of `lms`' log-probs [B, R] of the responses (0 off the policy's tokens) and the
    reward model's scores [B] (None without one), on the batch's device."""
    models = lms if reward_model is None else [*lms, reward_model]
    if packed and all(packs(m) for m in models):
        view = packed_view(batch)
        lps = [view.restore(A.gather_logprobs(view.logits(lm), view.targets, temperature))
               * batch.loss_mask for lm in lms]
        rm = None if reward_model is None else \
            reward_model(view.input_ids, None, view.position_ids)[view.last]
        return lps, rm
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    lps = [A.gather_logprobs(response_logits(lm, *args), batch.response_ids, temperature)
           * batch.loss_mask for lm in lms]
    return lps, None if reward_model is None else sequence_scores(reward_model, *args)
