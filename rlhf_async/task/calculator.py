"""The built-in tool-use task: multiply two numbers, with a `calc(...)` tool at hand.

A prompt is `a*b=` (two-digit operands, far past what the tiny model can multiply). An
episode: the policy either answers at once, or calls the tool (`calc(a*b)`, ending at `)`),
reads its result (an environment turn) and answers; the environment rewards an exact answer
with 1. The SFT demonstrations call the tool only `TOOL_SHARE` of the time and answer
directly (correctly) otherwise, so the SFT policy learns the call format and the copy but
calls too rarely, and guesses; RL raises how often it calls, and with it the held-out exact
match (the hidden score).

Tokens are characters (and the one token `calc(`); the model is the built-in tiny one.
`CalculatorTokenizer` is the same tokens behind the tokenizer interface, its chat template
the episode's format (a question, the policy's turns, the tool's results), so that an agent
(`task.agent`) plays these episodes through the endpoint token for token as `CalculatorEnv`
does in process.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import PreTrainedTokenizer

from rlhf_async.config import JobConfig
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.environment import EpisodeSpec
from rlhf_async.modeling.rollout import ENV, POLICY, PromptBatch

PAD, BOS, EOS, SEP, OBS, CALL, CLOSE = range(7)
TEXT = {PAD: "", BOS: "", EOS: "", SEP: "=", OBS: "\n>", CALL: "calc(", CLOSE: ")"}
CHARS = "0123456789+-*?"
TEXT.update({len(TEXT) + i: c for i, c in enumerate(CHARS)})
ID = {c: i for i, c in TEXT.items() if c}
VOCAB_SIZE = 24  # 21 tokens, rounded up
OPERANDS = (10, 99)  # a and b of `a*b`
TOOL_SHARE = 0.3  # of the demonstrations, those that call the tool
_EXPR = re.compile(r"\d{1,6}([+*-]\d{1,6}){0,3}")


def encode(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        tok = next((m for m in ("calc(", "\n>") if text.startswith(m, i)), text[i])
        if tok not in ID:
            raise ValueError(f"calculator: no token for {text[i]!r} in {text!r}")
        out.append(ID[tok])
        i += len(tok)
    return out


def decode(ids: list[int]) -> str:
    return "".join(TEXT.get(int(t), "") for t in ids)


def calc(expr: str) -> str:
    """The tool: an integer expression of + - * (nothing else is evaluated); "?" for
    anything else (a failed call the policy reads)."""
    if not _EXPR.fullmatch(expr):
        return "?"
    plain = re.sub(r"\d+", lambda m: str(int(m.group())), expr)  # no leading zeros
    return str(eval(plain, {"__builtins__": {}}, {}))  # digits and + - * only


# a conversation in the episode's tokens: BOS question, then SEP before each policy turn,
# OBS before each tool result (a system turn has no tokens here: refused)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ '<s>' + m.content }}"
    "{% elif m.role == 'tool' %}{{ '\\n>' + m.content }}"
    "{% elif m.role == 'assistant' %}{{ '=' + m.content }}"
    "{% else %}{{ raise_exception('the calculator has no ' + m.role + ' turn; send the "
    "question as the user turn, calc results as tool turns') }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}")
_SPECIAL = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}


class CalculatorTokenizer(PreTrainedTokenizer):
    """The calculator's tokens as a tokenizer with a chat template (see the module)."""

    vocab: ClassVar[dict[str, int]] = {**{t: i for i, t in TEXT.items() if t},
                                       **{t: i for i, t in _SPECIAL.items()}}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(pad_token=_SPECIAL[PAD], bos_token=_SPECIAL[BOS],
                         eos_token=_SPECIAL[EOS], chat_template=CHAT_TEMPLATE, **kwargs)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [TEXT[t] for t in encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.vocab[token]

    def _convert_id_to_token(self, index: int) -> str:
        return _SPECIAL.get(index) or TEXT.get(index) or _SPECIAL[PAD]


class CalculatorEnv:
    """Answers `calc(...)` with its value; any other turn is the final answer, 1 if exact."""

    def __init__(self) -> None:
        self.answer = ""

    async def reset(self, row: dict[str, Any]) -> str:
        self.answer = str(row["answer"])
        return ""  # the prompt already asks

    async def step(self, action: str) -> tuple[str, float, bool]:
        if action.startswith("calc(") and action.endswith(")"):
            return calc(action[len("calc("):-1]), 0.0, False
        return "", float(action == self.answer), True


class CalculatorTask:
    """Prompts, demonstrations and the episode setup, all keyed by a seed."""

    eos_id, pad_id = EOS, PAD
    rule_reward = True  # the environment's reward is the reward (no reward model)
    has_rule = True
    special = (PAD, BOS, EOS)
    stop_ids: tuple[int, ...] = (CLOSE,)  # a tool call ends at its `)`
    prompt_len = 1 + 5 + 1  # BOS a*b =

    def __init__(self, cfg: JobConfig, driver: Any = None) -> None:
        self.cfg = cfg
        self.driver = driver  # task.agent's episodes (`task/agents/agent.py`), else CalculatorEnv's

    @property
    def decode(self) -> Any:
        return decode

    def episode_spec(self) -> EpisodeSpec:
        t = self.cfg.task
        if self.driver is not None:
            return EpisodeSpec(CalculatorEnv, self.row, self.render, decode, t.max_turns,
                               self.cfg.generation.max_episode_tokens, t.agent_timeout_s,
                               t.agent, self.driver)
        return EpisodeSpec(CalculatorEnv, self.row, self.render, decode, t.max_turns,
                           self.cfg.generation.max_episode_tokens, t.env_timeout_s,
                           "calculator")

    @staticmethod
    def row(prompt: list[int]) -> dict[str, Any]:
        expr = decode(prompt).rstrip("=")
        return {"prompt": expr, "answer": calc(expr)}

    @staticmethod
    def render(observation: str) -> list[int]:
        """An environment turn: OBS, the tool's text, SEP (the policy answers after it)."""
        return [OBS, *encode(observation), SEP]

    # ---- prompts -------------------------------------------------------------------------
    def _draw(self, rng: random.Random, heldout: bool) -> tuple[int, int]:
        while True:
            a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
            if (key_seed(0, "heldout", a, b) % 8 == 0) == heldout:
                return a, b

    def problems(self, seed: int, purpose: str, step: int, count: int) -> list[str]:
        rng = random.Random(key_seed(seed, "calc-prompts", purpose, step))
        return [f"{a}*{b}" for a, b in (self._draw(rng, purpose == "eval")
                                        for _ in range(count))]

    def encode_prompts(self, problems: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.full((len(problems), self.prompt_len), PAD, dtype=torch.long)
        for i, p in enumerate(problems):
            toks = [BOS, *encode(p), SEP]
            ids[i, self.prompt_len - len(toks):] = torch.tensor(toks)
        return ids, (ids != PAD).long()

    def prompt_batch(self, seed: int, purpose: str, step: int, count: int,
                     group_size: int) -> PromptBatch:
        problems = self.problems(seed, purpose, step, count)
        ids, mask = self.encode_prompts([p for p in problems for _ in range(group_size)])
        n = count * group_size
        sample_ids = torch.arange(step * n, (step + 1) * n, dtype=torch.long)
        return PromptBatch(ids, mask, sample_ids, sample_ids // group_size)

    # ---- demonstrations and the hidden score ------------------------------------------------
    def demonstrations(self, seed: int, step: int, count: int,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """An SFT batch: prompts, and episodes whose environment turns are marked ENV (the
        loss skips them): `TOOL_SHARE` call the tool, the others answer at once."""
        problems = self.problems(seed, "sft", step, count)
        rng = random.Random(key_seed(seed, "calc-demo", step))
        width = self.cfg.generation.max_episode_tokens
        ids = torch.full((count, width), PAD, dtype=torch.long)
        kinds = torch.zeros_like(ids)
        for i, p in enumerate(problems):
            answer = [*encode(calc(p)), EOS]
            turns = [(answer, POLICY)]
            if rng.random() < TOOL_SHARE:
                turns = [([CALL, *encode(p), CLOSE], POLICY), (self.render(calc(p)), ENV),
                         *turns]
            toks = [t for seg, _ in turns for t in seg][:width]
            marks = [k for seg, k in turns for _ in seg][:width]
            ids[i, :len(toks)], kinds[i, :len(toks)] = torch.tensor(toks), torch.tensor(marks)
        return (*self.encode_prompts(problems), ids, kinds)

    def hidden_scores(self, prompt_ids: Tensor, response_ids: Tensor,
                      response_mask: Tensor) -> Tensor:
        """[B] exact match of each episode's last policy turn (its environment's reward)."""
        out = []
        for p, r, m in zip(prompt_ids.tolist(), response_ids.tolist(), response_mask.tolist(),
                           strict=True):
            last: list[int] = []
            for t, k in zip(r, m, strict=True):
                if k == ENV:
                    last = []
                elif k == POLICY:
                    last.append(t)
            answer = self.row([t for t in p if t != PAD])["answer"]
            out.append(float(bool(last) and last[-1] == EOS and decode(last) == answer))
        return torch.tensor(out, dtype=torch.float32)
