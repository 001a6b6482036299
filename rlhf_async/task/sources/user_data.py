"""The user's demonstrations and preference pairs, tokenised, split and batched for the
supervised stages (`rlhf-async sft`, `rlhf-async rm`).

Demonstrations (`sft.data`): a row's `prompt_key` + `response_key` strings, or its
`messages_key` chat whose last turn (the assistant's) is the response. Pairs
(`reward_model.data`): `prompt_key` (a string or a chat) with `chosen_key` / `rejected_key`
responses (strings, or chats whose last turn is the response; their earlier turns are the
prompt when the row has no `prompt_key`). Prompts are encoded as the RL prompts are
(`task/sources/tokens.py`, `task.chat_template`), so the policy is trained on the prompt format RL
will show it. About one row in eight is held out by a hash of its prompt, as for RL
prompts; training steps walk the rest in keyed shuffled epochs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError
from rlhf_async.task.sources.dataset import Row, load_rows
from rlhf_async.task.sources.tokens import (
    Prompt,
    check_chat,
    encode_prompt,
    encode_response,
    split_chat,
)
from rlhf_async.task.supervised import Batch, pad_batch
from rlhf_async.task.text import epoch_walk, heldout_split, split_key

MAX_PROBLEMS = 20


@dataclass
class Tokenised:
    """Rows as token lists: `prompts[i]` with one response per column (SFT: one; pairs:
    chosen, rejected), split into training and held-out rows."""

    prompts: list[list[int]]
    responses: list[list[list[int]]]  # [column][row]
    pad_id: int
    train_idx: list[int] = field(default_factory=list)
    eval_idx: list[int] = field(default_factory=list)
    truncated: int = 0  # rows whose responses were cut to the token limit

    def batch(self, indices: list[int]) -> Batch:
        """Rows `indices`: for pairs, chosen rows then rejected rows (supervised.py)."""
        prompts = [self.prompts[i] for col in self.responses for i in indices]
        responses = [col[i] for col in self.responses for i in indices]
        return pad_batch(prompts, responses, self.pad_id)

    def train_batch(self, seed: int, purpose: str, step: int, size: int) -> Batch:
        return self.batch(epoch_walk(self.train_idx, seed, purpose, step, size))

    def eval_batches(self, size: int) -> list[Batch]:
        idx = self.eval_idx
        return [self.batch(idx[i:i + size]) for i in range(0, len(idx), size)]

    def stats(self) -> dict[str, int]:
        return {"rows": len(self.prompts), "train_rows": len(self.train_idx),
                "heldout_rows": len(self.eval_idx), "truncated_rows": self.truncated}


def _response(value: Any, where: str) -> tuple[list[dict[str, Any]], str]:
    """(the turns before it, the response text) of a response column's value."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError([f"{where}: an empty response"])
        return [], value
    before, text = split_chat(check_chat(value, where))
    if text is None:
        raise ConfigError([f"{where}: the chat's last turn is not the assistant's (the "
                           "response)"])
    return before, text


def demonstration(row: Row, i: int, source: str, keys: Any) -> tuple[Prompt, str]:
    """(prompt, response) of SFT row `i` (`keys`: the sft config section)."""
    where = f"sft.data: {source}: row {i}"
    prompt, response = row.get(keys.prompt_key), row.get(keys.response_key)
    if isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and \
            response.strip():
        return prompt, response
    if prompt is None and row.get(keys.messages_key) is not None:
        chat_at = f"{where} ({keys.messages_key!r})"
        before, text = _response(check_chat(row[keys.messages_key], chat_at), chat_at)
        if not before:
            raise ConfigError([f"{where}: the chat in {keys.messages_key!r} has no turn "
                               "before the response"])
        return before, text
    raise ConfigError([f"{where}: expected non-empty strings in {keys.prompt_key!r} and "
                       f"{keys.response_key!r} (sft.prompt_key, sft.response_key) or a chat "
                       f"in {keys.messages_key!r} (sft.messages_key); its columns: "
                       f"{sorted(row)}"])


def preference(row: Row, i: int, source: str, keys: Any) -> tuple[Prompt, str, str]:
    """(prompt, chosen, rejected) of preference row `i` (`keys`: reward_model section)."""
    where = f"reward_model.data: {source}: row {i}"
    missing = [k for k in (keys.chosen_key, keys.rejected_key) if row.get(k) is None]
    if missing:
        raise ConfigError([f"{where}: no {' or '.join(map(repr, missing))} (reward_model."
                           f"chosen_key / rejected_key); its columns: {sorted(row)}"])
    before_c, chosen = _response(row[keys.chosen_key], f"{where} ({keys.chosen_key!r})")
    before_r, rejected = _response(row[keys.rejected_key], f"{where} ({keys.rejected_key!r})")
    if before_c != before_r:
        raise ConfigError([f"{where}: {keys.chosen_key!r} and {keys.rejected_key!r} differ "
                           "before their last turn; a pair answers one prompt"])
    prompt = row.get(keys.prompt_key)
    if prompt is None:
        if not before_c:
            raise ConfigError([f"{where}: no prompt: neither a {keys.prompt_key!r} column "
                               "(reward_model.prompt_key) nor earlier turns in the chats"])
        return before_c, chosen, rejected
    if isinstance(prompt, str) and prompt.strip():
        chat_prompt: Prompt = prompt if not before_c else \
            [{"role": "user", "content": prompt}, *before_c]
        return chat_prompt, chosen, rejected
    if isinstance(prompt, list):
        return [*check_chat(prompt, f"{where} ({keys.prompt_key!r})"), *before_c], chosen, \
            rejected
    raise ConfigError([f"{where}: {keys.prompt_key!r} is {prompt!r}; expected a non-empty "
                       "string or a chat"])


def tokenise(key: str, source: str, split: str, parse: Any, keys: Any,
             tok: PreTrainedTokenizerBase, chat_template: bool, max_tokens: int,
             ) -> Tokenised:
    """Read `source`, parse each row with `parse` (demonstration or preference), encode it
    within `max_tokens` (a longer response is cut; a prompt that leaves no room for one
    token is an error) and split off the held-out rows. Every bad row: one ConfigError."""
    rows = load_rows(source, key, split)
    problems: list[str] = []
    prompts: list[list[int]] = []
    keys_of: list[str] = []
    responses: list[list[list[int]]] = []
    truncated = 0
    for i, row in enumerate(rows):
        try:
            prompt, *texts = parse(row, i, source, keys)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        p = encode_prompt(tok, prompt, chat_template)
        if len(p) >= max_tokens:
            problems.append(f"{key}: {source}: row {i}: the prompt is {len(p)} tokens, which "
                            f"leaves no room for a response within {max_tokens} tokens "
                            f"({key.split('.')[0]}.max_tokens, or the model's context)")
            continue
        encoded = [encode_response(tok, t) for t in texts]
        cut = [r[: max_tokens - len(p)] for r in encoded]
        truncated += any(len(c) < len(r) for c, r in zip(cut, encoded, strict=True))
        if not responses:
            responses = [[] for _ in cut]
        for col, r in zip(responses, cut, strict=True):
            col.append(r)
        prompts.append(p)
        keys_of.append(split_key(prompt))
    if problems:
        raise ConfigError(problems[:MAX_PROBLEMS] + ([f"{key}: ... {len(problems)} bad rows "
                                                      "in all"] if len(problems) >
                                                     MAX_PROBLEMS else []))
    if len(prompts) < 2:
        raise ConfigError([f"{key}: {source!r} holds {len(prompts)} row(s); training needs "
                           ">= 2 (about one in eight is held out for evaluation)"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    data = Tokenised(prompts, responses, int(pad), truncated=truncated)
    data.train_idx, data.eval_idx = heldout_split(keys_of)
    return data
