"""The "text" task: the user's prompts (a JSONL or .txt file), judged by the user's rule
reward, a trained reward model (`reward_model.path`), or both with weights.

Prompts are tokenised once with the tokenizer in `model.path` (through its chat template
unless `task.chat_template = false`) and left-padded to one fixed width: the longest
prompt of the file. A fixed hash of each prompt's text holds about one in eight out for
evaluation (at least one), so adding prompts to the file never moves one between the
splits. Training steps walk the training prompts in a keyed shuffle per epoch.

The rule is `task.reward(prompt, response)` on the decoded response (up to EOS); with no
reward model it is both the training reward and the reported `hidden_score`. A reward model
scores the policy's own token ids, so it must share the policy's tokenizer (checked here;
one with another vocabulary is refused rather than re-tokenised).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.modeling.determinism import key_seed
from rlhf_async.modeling.rollout import PromptBatch
from rlhf_async.task.reward_fn import call_reward, load_reward_fn

HELDOUT_ONE_IN = 8


def read_prompts(path: str) -> list[str]:
    """Prompts of a .jsonl file ({"prompt": "..."} per line) or of any other text file (one
    per line); blank lines are skipped. Every bad line is reported in one ConfigError."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError([f"task.prompts: {path!r} not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"task.prompts: cannot read {path!r} ({e})"]) from None
    prompts, problems = [], []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"task.prompts: {path}:{n}: not JSON ({e})")
            continue
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            problems.append(f"task.prompts: {path}:{n}: expected {{\"prompt\": \"...\"}} "
                            "with a non-empty string")
            continue
        prompts.append(text)
    if not problems and len(prompts) < 2:
        problems.append(f"task.prompts: {path!r} holds {len(prompts)} prompt(s); the text "
                        "task needs >= 2 (one is held out for evaluation)")
    if problems:
        raise ConfigError(problems)
    return prompts


def heldout_split(prompts: list[str]) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): a prompt is held out when its text hashes to 0 mod 8;
    when none does (small files) the one with the smallest hash is."""
    h = [key_seed(0, "heldout", p) for p in prompts]
    held = [i for i, x in enumerate(h) if x % HELDOUT_ONE_IN == 0]
    if not held:
        held = [min(range(len(prompts)), key=h.__getitem__)]
    if len(held) == len(prompts):
        held = held[:-1]
    train = [i for i in range(len(prompts)) if i not in set(held)]
    return train, held


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    msg = f"model.path: no usable tokenizer in {path!r} (the text task needs one"
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError([f"{msg}) ({e})"]) from None
    if not tok("a b c 1 2 3")["input_ids"]:  # no tokenizer files: transformers builds an
        # empty one from the model's config silently, and every prompt becomes no tokens
        raise ConfigError([f"{msg}: tokenizer.json or the vocabulary files of its "
                           "tokenizer class; it has none)"])
    return tok


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
        self.cfg, self.reward_spec = t, t.reward
        self.tokenizer = _load_tokenizer(cfg.model.path)
        self.prompts = read_prompts(t.prompts)
        self.reward_fn = load_reward_fn(t.reward) if t.reward else None
        self.has_rule = self.reward_fn is not None
        self.rule_reward = not cfg.reward_model.path  # no reward model: the rule is it
        for key, path in (("reward_model.path", cfg.reward_model.path),
                          ("critic.path", cfg.critic.path)):
            if path:
                _check_reward_tokenizer(key, path, self.tokenizer, cfg.model.path)
        if self.tokenizer.eos_token_id is None:
            raise ConfigError([(f"model.path: the tokenizer in {cfg.model.path!r} has no "
                                "EOS token (generation needs one to stop)")])
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)  # masks mark the padding
        self.tokens = [self._encode(p) for p in self.prompts]
        self._check_lengths()
        self.prompt_len = max(len(x) for x in self.tokens)
        self.index_of: dict[tuple[int, ...], int] = {}  # tokens -> first prompt index
        for i, toks in enumerate(self.tokens):
            self.index_of.setdefault(tuple(toks), i)
        self.train_idx, self.eval_idx = heldout_split(self.prompts)

    def _encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if not self.cfg.chat_template:
            return list(tok(prompt).input_ids)
        if not getattr(tok, "chat_template", None):
            raise ConfigError([("task.chat_template: the tokenizer in model.path has no "
                                "chat template; set task.chat_template = false")])
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False).input_ids)

    def _check_lengths(self) -> None:
        limit = self.cfg.max_prompt_tokens
        long = [f"task.prompts: prompt {i} is {len(x)} tokens, over task.max_prompt_tokens = "
                f"{limit}" for i, x in enumerate(self.tokens) if len(x) > limit]
        empty = [f"task.prompts: prompt {i} is no tokens" for i, x in enumerate(self.tokens)
                 if not x]
        if long or empty:
            raise ConfigError((long + empty)[:20])

    # ---- prompts -------------------------------------------------------------------------
    def prompt_indices(self, seed: int, purpose: str, step: int, count: int) -> list[int]:
        """Indices into `prompts`: 'eval' = the held-out ones (at most `count`, in file
        order); anything else = `count` training prompts, each epoch a keyed shuffle."""
        if purpose == "eval":
            return self.eval_idx[:count]
        n, out = len(self.train_idx), []
        for k in range(step * count, (step + 1) * count):
            epoch = k // n
            order = list(self.train_idx)
            random.Random(key_seed(seed, "text-epoch", purpose, epoch)).shuffle(order)
            out.append(order[k % n])
        return out

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
            return i, self.prompts[i]
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
        """[B] rule rewards of decoded (prompt, response) pairs."""
        if self.reward_fn is None:
            raise ValueError("this text task has no rule (task.reward); its reward model "
                             "scores it")
        prompt_mask = self._mask_of(prompt_ids)
        out = []
        for p, pm, r, m in zip(prompt_ids, prompt_mask, response_ids, response_mask,
                               strict=True):
            index, prompt = self._prompt_of(p, pm)
            response = self.response_text(r, m)
            out.append(call_reward(self.reward_fn, self.reward_spec, prompt, response, index,
                                   self.cfg.reward_timeout_s))
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
