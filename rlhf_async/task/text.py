"""The "text" task: the user's prompts (any source `task/sources/dataset.py` reads), judged by the
user's rule reward, a trained reward model (`reward_model.path`), or both with weights.

A row's prompt is its `task.prompt_key` string, or else its `task.messages_key` chat (a last
assistant turn, a reference answer, is dropped). Prompts are tokenised once with the
tokenizer in `model.path` (`task/sources/tokens.py`) and left-padded to one fixed width: the longest
prompt. A fixed hash of each prompt holds about one in eight out for evaluation (at least
one), so adding rows never moves one between the splits. Training steps walk the training
prompts in a keyed shuffle per epoch.

The rule is `task.reward` on the decoded response (up to EOS): per sample
`f(prompt, response, **columns)`, or with `task.reward_batched` once per batch
`f(prompts, responses, **columns) -> list[float]`; `columns` are the row's other columns
(by name, those f takes); or a reward server (`task/rewards/remote_reward.py`) sent the same.
With no reward model it is both the training reward and the reported `hidden_score`. A
reward model scores the policy's own token ids, so it must share the policy's tokenizer
(checked here; one with another vocabulary is refused rather than re-tokenised).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError, JobConfig, TaskConfig
from rlhf_async.config.checks import context_problem
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.environment import Env, EpisodeSpec
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.task.adapters import EnvironmentAdapter, Rows, Scorer, chosen
from rlhf_async.task.agents import agent_episodes
from rlhf_async.task.agents.agent_session import NO_ENV
from rlhf_async.task.agents.environment import load_env, template_delta
from rlhf_async.task.rewards.remote_reward import load_rule
from rlhf_async.task.sources.dataset import load_rows
from rlhf_async.task.sources.tokens import (
    Prompt,
    check_chat,
    encode_prompt,
    load_tokenizer,
    prompt_text,
    split_chat,
)

if TYPE_CHECKING:
    from rlhf_async.task.agents.agent import AgentEpisodes

HELDOUT_ONE_IN = 8


def read_prompts(t: TaskConfig, adapters: list[EnvironmentAdapter] | None = None) -> Rows:
    """The rows of the adapter that gives the prompts, else of `task.prompts` (each row's
    prompt and its other columns; every bad row reported in one ConfigError, the first
    20)."""
    for adapter in chosen(t) if adapters is None else adapters:
        given = adapter.rows()
        if given is not None:
            return given
    rows = load_rows(t.prompts, "task.prompts", t.split, text_column=t.prompt_key)
    prompts: list[Prompt] = []
    columns, problems = [], []
    for i, row in enumerate(rows):
        where = f"task.prompts: {t.prompts}: row {i}"
        value = row.get(t.prompt_key)
        try:
            if value is None and row.get(t.messages_key) is not None:
                chat = split_chat(check_chat(row[t.messages_key], where))[0]
                prompts.append(check_chat(chat, f"{where} (without its last assistant turn)"))
            elif isinstance(value, str) and value.strip():
                prompts.append(value)
            else:
                raise ConfigError([f"{where}: expected a non-empty string in "
                                   f"{t.prompt_key!r} (task.prompt_key) or a chat in "
                                   f"{t.messages_key!r} (task.messages_key); its columns: "
                                   f"{sorted(row)}"])
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        columns.append({k: v for k, v in row.items() if k != t.prompt_key})
    if not problems and len(prompts) < 2:
        problems.append(f"task.prompts: {t.prompts!r} holds {len(prompts)} prompt(s); the "
                        "text task needs >= 2 (one is held out for evaluation)")
    if problems:
        raise ConfigError(problems[:20])
    return Rows(prompts, columns)


def longest_prompt(model_path: str, t: TaskConfig) -> int:
    """`task.max_prompt_tokens`, or when it is 0 the longest prompt of `task.prompts` as the
    stages tokenise it (chat template included): what the planner prices."""
    if t.max_prompt_tokens:
        return t.max_prompt_tokens
    return _longest_in_data(model_path, json.dumps(dataclasses.asdict(t), sort_keys=True))


@functools.lru_cache(maxsize=4)
def _longest_in_data(model_path: str, task: str) -> int:
    t = TaskConfig(**json.loads(task))
    tok = load_tokenizer(model_path)
    return max(len(encode_prompt(tok, p, t.chat_template)) for p in read_prompts(t).prompts)


def heldout_split(prompts: list[str]) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): a prompt is held out when its text hashes to 0 mod 8;
    when none does (small files) the one with the smallest hash is (every row of it)."""
    h = [key_seed(0, "heldout", p) for p in prompts]
    held = [i for i, x in enumerate(h) if x % HELDOUT_ONE_IN == 0]
    if not held:
        held = [i for i, x in enumerate(h) if x == min(h)]
    if len(held) == len(prompts):
        held = held[:-1]
    train = [i for i in range(len(prompts)) if i not in set(held)]
    return train, held


def split_key(prompt: Prompt) -> str:
    """The text a row's held-out hash is of: the prompt, or a chat's last user turn, so a
    question is held out (or not) alike in every stage and format: as an RL prompt string,
    as an SFT chat, as a preference pair's prompt."""
    return prompt_text(prompt)


def epoch_walk(indices: list[int], seed: int, purpose: str, step: int, count: int,
               ) -> list[int]:
    """`count` of `indices` for step `step`: the k-th pick overall is in epoch k // n, and
    each epoch is a shuffle keyed by (seed, purpose, epoch)."""
    n, orders = len(indices), {}
    out = []
    for k in range(step * count, (step + 1) * count):
        epoch = k // n
        if epoch not in orders:  # one shuffle per epoch touched, not one per pick
            orders[epoch] = list(indices)
            random.Random(key_seed(seed, "text-epoch", purpose, epoch)).shuffle(orders[epoch])
        out.append(orders[epoch][k % n])
    return out


def _check_reward_tokenizer(key: str, path: str, tok: PreTrainedTokenizerBase,
                            policy: str) -> None:
    """A reward model (or critic) reads the policy's token ids: its tokenizer (when it has
    one) must be the policy's, and its embeddings must cover the policy's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    key = f"{key}: {path!r}"
    try:
        theirs = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        theirs = None  # no tokenizer files: its vocabulary size is checked below
    if theirs is not None and theirs("a b c 1 2 3")["input_ids"] and \
            theirs.get_vocab() != tok.get_vocab():
        raise ConfigError([f"{key} has another tokenizer than model.path {policy!r} "
                           f"({len(theirs)} vs {len(tok)} tokens); it scores the policy's "
                           "token ids, so use a model trained on the policy's "
                           "tokenizer (this build does not re-tokenise by text)"])
    vocab = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tok):
        raise ConfigError([f"{key} embeds {vocab} tokens; the policy's tokenizer has "
                           f"{len(tok)}"])


class TextTask:
    """The user's prompts, tokenised; the user's reward on decoded responses."""

    def __init__(self, cfg: JobConfig) -> None:
        t = cfg.task
        if not cfg.model.path:
            raise ConfigError([("model.path: task.name = 'text' needs a local Hugging Face "
                                "model directory with a tokenizer")])
        self.cfg = t
        self.tokenizer = load_tokenizer(cfg.model.path)
        adapters = chosen(t)  # task.env's or task.prompts' (task/adapters/)
        rows = read_prompts(t, adapters)
        self.prompts, self.columns = rows.prompts, rows.columns
        # task.reward, else an adapter's own scorer
        self.rule: Scorer | None = load_rule(t, "task.prompts") if t.reward else \
            next((r for a in adapters if (r := a.rule()) is not None), None)
        # an environment's (an agent's) rewards are its rule
        self.has_rule = self.rule is not None or bool(t.env) or bool(t.agent)
        self.rule_reward = not cfg.reward_model.path  # no reward model: the rule is it
        for key, path in (("reward_model.path", cfg.reward_model.path),
                          ("critic.path", cfg.critic.path)):
            if path:
                _check_reward_tokenizer(key, path, self.tokenizer, cfg.model.path)
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)  # masks mark the padding
        self.tokens = [encode_prompt(self.tokenizer, p, t.chat_template) for p in self.prompts]
        self._check_lengths(cfg)
        self.prompt_len = max(len(x) for x in self.tokens)
        self.index_of: dict[tuple[int, ...], int] = {}  # tokens -> first prompt index
        for i, toks in enumerate(self.tokens):
            self.index_of.setdefault(tuple(toks), i)
        if rows.heldout is not None:  # the adapter's own split
            self.train_idx = [i for i, h in enumerate(rows.heldout) if not h]
            self.eval_idx = [i for i, h in enumerate(rows.heldout) if h]
        else:
            self.train_idx, self.eval_idx = heldout_split([split_key(p) for p in self.prompts])
        self.env, self.agent = self._episodes(t, adapters)
        if self.env is not None:  # a tokenizer without a chat template: stopped before work
            template_delta(self.tokenizer)
        self.max_turns, self.env_timeout_s = t.max_turns, t.env_timeout_s
        if self.agent is not None and t.max_prompt_tokens:
            # an agent renders its own prompt (a system turn, examples), not the data's:
            # task.max_prompt_tokens is its room, or the rest would be response tokens
            self.prompt_len = t.max_prompt_tokens
        self.max_episode_tokens = cfg.generation.max_episode_tokens

    stop_ids: tuple[int, ...] = ()

    def _episodes(self, t: TaskConfig, adapters: list[EnvironmentAdapter],
                  ) -> tuple[Callable[[], Env] | None, AgentEpisodes | None]:
        """(environment class, agent driver): an adapter's, else `task.env`'s or
        `task.agent`'s (at most one of them: the config checks)."""
        for adapter in adapters:
            env, agent = adapter.environment(), adapter.agent(self.tokenizer)
            if env is not None or agent is not None:
                return env, agent
        return (load_env(t.env) if t.env else None,
                agent_episodes(t.agent, self.tokenizer) if t.agent else None)

    def episode_spec(self) -> EpisodeSpec | None:
        """With `task.env`: its episodes, observations as the chat template's tool turns;
        with `task.agent`: the agent's, through the endpoint (`task/agents/agent.py`)."""
        if self.agent is not None:
            return EpisodeSpec(lambda: NO_ENV, self.env_row, lambda _: [], self.decode,
                               self.max_turns, self.max_episode_tokens,
                               self.cfg.agent_timeout_s, self.cfg.agent, self.agent)
        if self.env is None:
            return None
        render = template_delta(self.tokenizer, chat=self.cfg.chat_template)
        return EpisodeSpec(self.env, self.env_row, render, self.decode,
                           self.max_turns, self.max_episode_tokens, self.env_timeout_s,
                           self.cfg.env)

    def env_row(self, tokens: list[int]) -> dict[str, Any]:
        """What an environment's reset reads: the prompt's text and its row's columns."""
        i = self.index_of.get(tuple(tokens), -1)
        text = prompt_text(self.prompts[i]) if i >= 0 else self.decode(tokens)
        return {**(self.columns[i] if i >= 0 else {}), "prompt": text}

    def _check_lengths(self, cfg: JobConfig) -> None:
        """An explicit `task.max_prompt_tokens` refuses longer prompts (the config check
        fitted it to the context); 0 takes the data's longest, fitted to the context
        here."""
        limit = self.cfg.max_prompt_tokens
        long = [f"task.prompts: prompt {i} is {len(x)} tokens, over task.max_prompt_tokens = "
                f"{limit}" for i, x in enumerate(self.tokens) if limit and len(x) > limit]
        empty = [f"task.prompts: prompt {i} is no tokens" for i, x in enumerate(self.tokens)
                 if not x]
        if long or empty:
            raise ConfigError((long + empty)[:20])
        longest = max(len(x) for x in self.tokens)
        problem = None if limit else context_problem(
            cfg, longest, "the longest prompt in task.prompts; task.max_prompt_tokens = 0")
        if problem is not None:
            raise ConfigError([problem])

    # ---- prompts -------------------------------------------------------------------------
    def prompt_indices(self, seed: int, purpose: str, step: int, count: int) -> list[int]:
        """Indices into `prompts`: 'eval' = the held-out ones (at most `count`, in file
        order); anything else = `count` training prompts, each epoch a keyed shuffle."""
        if purpose == "eval":
            return self.eval_idx[:count]
        return epoch_walk(self.train_idx, seed, purpose, step, count)

    def encode_prompts(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        """Left-padded to the task's fixed width. -> ids [B, P], mask [B, P]."""
        ids = torch.full((len(indices), self.prompt_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(indices):
            toks = self.tokens[i]
            ids[row, self.prompt_len - len(toks):] = torch.tensor(toks)
            mask[row, self.prompt_len - len(toks):] = 1
        return ids, mask

    def prompt_batch(self, seed: int, purpose: str, step: int, count: int,
                     group_size: int) -> PromptBatch:
        """`count` prompts x `group_size` rows (fewer for 'eval' when the held-out set is
        smaller); sample ids are unique across steps."""
        indices = self.prompt_indices(seed, purpose, step, count)
        ids, mask = self.encode_prompts([i for i in indices for _ in range(group_size)])
        n = count * group_size
        sample_ids = torch.arange(step * n, step * n + ids.shape[0], dtype=torch.long)
        return PromptBatch(ids, mask, sample_ids, sample_ids // group_size)

    # ---- reward --------------------------------------------------------------------------
    def _prompt_of(self, prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[int, str]:
        toks = prompt_ids[prompt_mask.bool()].tolist()
        i = self.index_of.get(tuple(toks), -1)
        if i >= 0:
            return i, prompt_text(self.prompts[i])
        return -1, self.decode(toks)

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, as the rule reward and the stop strings see it (no special
        tokens)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def response_text(self, response_ids: Tensor, response_mask: Tensor) -> str:
        toks = response_ids[response_mask.bool()].tolist()
        if self.eos_id in toks:
            toks = toks[: toks.index(self.eos_id)]
        return self.decode(toks)

    def hidden_scores(self, prompt_ids: Tensor, response_ids: Tensor,
                      response_mask: Tensor) -> Tensor:
        """[B] rule rewards of decoded (prompt, response) pairs, with their rows' columns."""
        if self.rule is None:
            raise ValueError("this text task has no rule (task.reward); its reward model "
                             "scores it")
        prompt_mask = self._mask_of(prompt_ids)
        found = [self._prompt_of(p, pm) for p, pm in zip(prompt_ids, prompt_mask, strict=True)]
        responses = [self.response_text(r, m) for r, m in zip(response_ids, response_mask,
                                                               strict=True)]
        indices = [i for i, _ in found]
        columns = [self.columns[i] if i >= 0 else {} for i in indices]
        out = self.rule([p for _, p in found], responses, columns, indices)
        return torch.tensor(out, dtype=torch.float32)

    def _mask_of(self, prompt_ids: Tensor) -> Tensor:
        """[B, P] real-token mask: the longest suffix that is one of the file's prompts, else
        all after the leading padding (the pad id may be a real token too, e.g. EOS)."""
        mask = torch.zeros_like(prompt_ids)
        for row, ids in enumerate(prompt_ids.tolist()):
            start = next((s for s in range(len(ids)) if tuple(ids[s:]) in self.index_of),
                         None)
            if start is None:
                start = next((s for s, t in enumerate(ids) if t != self.pad_id), len(ids))
            mask[row, start:] = 1
        return mask
