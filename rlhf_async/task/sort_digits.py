"""The built-in task: answer a list of digits with the same digits, preferably sorted.

Prompts are short digit lists; demonstrations are random permutations of them (so the SFT
policy copies digits but ignores order); the hidden "true" score that labels preference
pairs rewards keeping the prompt's digits AND putting them in non-decreasing order. The
policy only ever sees the learned reward model; the hidden score is reported beside it so
reward hacking is visible.

The hidden score is also a text rule, `rule(prompt, response)` on the task's texts (a
prompt's digits; a response's tokens, one character each: `TOKEN_CHARS`), so that
`task.reward` can replace it with a function or a reward server on the same texts
(`rlhf-async serve-reward rlhf_async.task.sort_digits:rule` serves this very one).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import torch
from torch import Tensor

from rlhf_async.config import TaskConfig
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.task.rewards.remote_reward import load_rule

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_DIGIT = 4
VOCAB_SIZE = 16  # 4 specials + up to 10 digits, rounded up
# a response's text: token t is TOKEN_CHARS[t] (the two spare ids are digits 10 and 11)
TOKEN_CHARS = "_^|$0123456789ab"


class SortDigitsTask:
    """Prompts, demonstrations, hidden score and preference pairs, all keyed by a seed."""

    eos_id, pad_id = EOS, PAD
    rule_reward = False  # the policy is trained on a learned reward model
    has_rule = True  # the true score is known: reported as hidden_score
    decode = None  # digits, not text: no stop strings (config checks refuse them)

    @staticmethod
    def show(tokens: list[int]) -> str:
        """Tokens as the text samples.jsonl shows (`tokens_text`: "^3141|", "1134$"); an id
        past the task's own (a user's model with a larger vocabulary) as "<id>"."""
        n = len(TOKEN_CHARS)
        return "".join(TOKEN_CHARS[t] if 0 <= t < n else f"<{t}>" for t in tokens)
    stop_ids: tuple[int, ...] = ()

    @staticmethod
    def episode_spec() -> None:
        """One response per prompt: no environment."""
        return None

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.prompt_len = cfg.max_len + 2  # BOS digits SEP
        self.response_len = cfg.max_len + 1  # digits EOS
        self.special = (PAD, BOS, EOS)
        self.rule = load_rule(cfg, "the batch")  # None: the built-in hidden score

    # ---- prompts -------------------------------------------------------------------------
    def _is_heldout(self, digits: list[int]) -> bool:
        return key_seed(0, "heldout", *digits) % 8 == 0

    def _length(self, rng: random.Random) -> int:
        """A prompt's length: uniform in [min_len, max_len], or with `long_fraction` a
        long tail: that share uniform in (short_len, max_len], the rest in [min_len,
        short_len] (e.g. 90% of 3-4 digits and 10% of up to 8x as many)."""
        c = self.cfg
        if c.long_fraction == 0:  # the stream of the uniform draw stays as it always was
            return rng.randint(c.min_len, c.max_len)
        if rng.random() < c.long_fraction:
            return rng.randint(c.short_len + 1, c.max_len)
        return rng.randint(c.min_len, c.short_len)

    def _draw(self, rng: random.Random, heldout: bool) -> list[int]:
        while True:
            n = self._length(rng)
            digits = [rng.randrange(self.cfg.num_digits) for _ in range(n)]
            if self._is_heldout(digits) == heldout:
                return digits

    def prompts(self, seed: int, purpose: str, step: int, count: int) -> list[list[int]]:
        """`count` digit lists for (seed, purpose, step); 'eval' prompts are disjoint from
        all others (a fixed hash partition of the prompt space)."""
        rng = random.Random(key_seed(seed, "prompts", purpose, step))
        return [self._draw(rng, heldout=purpose == "eval") for _ in range(count)]

    def encode_prompts(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Left-padded to the task's fixed prompt width. -> ids [B, P], mask [B, P]."""
        ids = torch.full((len(prompts), self.prompt_len), PAD, dtype=torch.long)
        for i, digits in enumerate(prompts):
            toks = [BOS] + [FIRST_DIGIT + d for d in digits] + [SEP]
            ids[i, self.prompt_len - len(toks):] = torch.tensor(toks)
        return ids, (ids != PAD).long()

    def prompt_batch(self, seed: int, purpose: str, step: int, count: int,
                     group_size: int) -> PromptBatch:
        """`count` prompts x `group_size` rows; sample ids are unique across steps."""
        prompts = self.prompts(seed, purpose, step, count)
        ids, mask = self.encode_prompts([p for p in prompts for _ in range(group_size)])
        n = count * group_size
        sample_ids = torch.arange(step * n, (step + 1) * n, dtype=torch.long)
        group_ids = sample_ids // group_size
        return PromptBatch(ids, mask, sample_ids, group_ids)

    @staticmethod
    def answer_tokens(digits: list[int]) -> list[int]:
        return [FIRST_DIGIT + d for d in digits] + [EOS]

    def encode_responses(self, responses: list[list[int]], width: int) -> tuple[Tensor, Tensor]:
        """Token lists -> right-padded ids (cut at width). -> ids [B, R], mask [B, R]."""
        ids = torch.full((len(responses), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(responses), width), dtype=torch.long)
        for i, toks in enumerate(responses):
            toks = toks[:width]
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
        return ids, mask

    @staticmethod
    def decode_prompt(prompt_ids: Tensor) -> list[int]:
        return [int(t) - FIRST_DIGIT for t in prompt_ids.tolist() if t >= FIRST_DIGIT]

    # ---- the hidden preference -------------------------------------------------------------
    @staticmethod
    def hidden_score_tokens(prompt: list[int], response_tokens: list[int]) -> float:
        """content overlap x fraction of non-decreasing adjacent pairs; 0 without EOS."""
        if EOS not in response_tokens:
            return 0.0
        body = response_tokens[: response_tokens.index(EOS)]
        digits = [t - FIRST_DIGIT for t in body if t >= FIRST_DIGIT]
        overlap = sum((Counter(prompt) & Counter(digits)).values())
        content = overlap / max(len(prompt), len(body), 1)
        if len(digits) < 2:
            return 0.0
        order = sum(a <= b for a, b in itertools.pairwise(digits)) / (len(digits) - 1)
        return content * order

    def hidden_scores(self, prompt_ids: Tensor, response_ids: Tensor,
                      response_mask: Tensor) -> Tensor:
        """[B] hidden scores of a batch (tokens after the mask are ignored): the built-in
        score, or `task.reward`'s on the batch's texts."""
        prompts = [self.decode_prompt(p) for p in prompt_ids]
        responses = [r[m.bool()].tolist() for r, m in zip(response_ids, response_mask,
                                                           strict=True)]
        if self.rule is None:
            out = [self.hidden_score_tokens(p, r) for p, r in zip(prompts, responses,
                                                                   strict=True)]
        else:
            out = self.rule([digits_text(p) for p in prompts],
                            [tokens_text(r) for r in responses],
                            [{}] * len(prompts), list(range(len(prompts))))
        return torch.tensor(out, dtype=torch.float32)

    # ---- synthetic data for SFT and the reward model ---------------------------------------
    def demonstrations(self, seed: int, step: int, count: int) -> tuple[list[list[int]],
                                                                        list[list[int]]]:
        """(prompts, response tokens): each response a random permutation of its prompt."""
        prompts = self.prompts(seed, "sft", step, count)
        rng = random.Random(key_seed(seed, "demo", step))
        return prompts, [self.answer_tokens(rng.sample(p, len(p))) for p in prompts]

    def candidate(self, rng: random.Random, prompt: list[int]) -> list[int]:
        """Response tokens from a broad family where content and order vary independently:
        some digits replaced / dropped / added, then sorted and shuffled by k random swaps;
        a few run on without EOS and a few stop at once or after one digit (as a drifting
        policy does: a reward model that never saw an empty answer may score it highest)."""
        digits = list(prompt)
        n, r = len(digits), rng.random()
        if r < 0.08:
            return [FIRST_DIGIT + rng.randrange(self.cfg.num_digits)
                    for _ in range(self.response_len)]
        if r < 0.14:
            return self.answer_tokens(rng.sample(digits, rng.randint(0, 1)))
        if r < 0.35:
            for i in rng.sample(range(n), rng.randint(1, n)):
                digits[i] = rng.randrange(self.cfg.num_digits)
        elif r < 0.45 and n > 2:
            digits.pop(rng.randrange(n))
        elif r < 0.55 and n < self.cfg.max_len:
            digits.append(rng.randrange(self.cfg.num_digits))
        out, m = sorted(digits), len(digits)
        for _ in range(rng.choice([0, 1, 2, m, m * m])):
            i, j = rng.randrange(m), rng.randrange(m)
            out[i], out[j] = out[j], out[i]
        return self.answer_tokens(out)

    def preference_pairs(self, seed: int, purpose: str, step: int, count: int,
                         noise: float) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(prompts, chosen tokens, rejected tokens), labelled by the hidden score with
        Bradley-Terry noise."""
        prompts = self.prompts(seed, purpose, step, count)
        rng = random.Random(key_seed(seed, "pairs", purpose, step))
        chosen, rejected = [], []
        for p in prompts:
            a, b = self.candidate(rng, p), self.candidate(rng, p)
            ha, hb = self.hidden_score_tokens(p, a), self.hidden_score_tokens(p, b)
            p_a = 1.0 / (1.0 + math.exp(-(ha - hb) / noise))
            first = rng.random() < p_a
            chosen.append(a if first else b)
            rejected.append(b if first else a)
        return prompts, chosen, rejected


# ---- the hidden score as a text rule -----------------------------------------------------
def digits_text(digits: list[int]) -> str:
    """A prompt's text: its digits, e.g. "3141"."""
    return "".join(str(d) for d in digits)


def tokens_text(tokens: list[int]) -> str:
    """A response's text: one character per token (`TOKEN_CHARS`), EOS "$" included."""
    return "".join(TOKEN_CHARS[t] for t in tokens)


def rule(prompt: str, response: str) -> float:
    """The hidden score of a response on the task's texts (`digits_text`, `tokens_text`):
    what `SortDigitsTask.hidden_score_tokens` gives on their tokens."""
    if not prompt.isdigit() or not prompt.isascii():
        raise ValueError(f"prompt {prompt!r} is not digits")
    bad = set(response) - set(TOKEN_CHARS)
    if bad:
        raise ValueError(f"response {response!r} holds {sorted(bad)}, not characters of "
                         f"{TOKEN_CHARS!r}")
    return SortDigitsTask.hidden_score_tokens([int(c) for c in prompt],
                                              [TOKEN_CHARS.index(c) for c in response])
