"""A tiny word-level tokenizer + GPT-2 saved as a local HF directory, for text-task tests
(the built-in model has no tokenizer; nothing may come from a hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<user>", "<bot>"]
WORDS = ["name", "a", "list", "three", "give", "one", "what", "is", "the", "colour", "fruit", "animal", "red", "blue", "green", "apple", "pear", "cat", "dog", "yes", "no", "sky", "sea", "big", "small", ".", "?", "!", ","]
TEMPLATE = ("{% for m in messages %}<user> {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} <bot>{% endif %}")


def make_text_model(out: Path, chat_template: bool = True, positions: int = 64) -> Path:
    """Write tokenizer + a 1-layer GPT-2 (seeded, `positions` long) to `out`; returns
    `out`."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)  # whole tokens, not split by the pre-tokenizer
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=positions, n_embd=32, n_layer=1, n_head=2,
                     pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"],
                     bos_token_id=vocab["<bos>"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        GPT2LMHeadModel(cfg).save_pretrained(out, safe_serialization=True)
    return out


PROMPTS = ["name a fruit .", "name a colour .", "list three animal .", "what is the sky ?",
           "give one fruit .", "name a big animal .", "what colour is the sea ?"]


def text_job_files(d: Path, code_file: str, code: str) -> Path:
    """`d` with the prompts, the user's code (an environment or agent) and the tiny model:
    what a text-task job with user code needs."""
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / code_file).write_text(code)
    make_text_model(d / "model")
    return d


def text_job_overrides(files: Path, out: Path, name: str) -> list[str]:
    """The overrides every short text-task job of the tests shares (GRPO, 2 steps of 4
    prompts x 2): add the task's own (task.env / task.agent, token limits)."""
    return [f"model.path={json.dumps(str(files / 'model'))}", "task.name=text",
            f"task.prompts={json.dumps(str(files / 'prompts.jsonl'))}",
            "generation.max_new_tokens=4", "task.max_prompt_tokens=32", "train.steps=2",
            "train.prompts_per_step=4", "algo.group_size=2", "algo.name=grpo",
            "run.plot=false", "run.progress=false", f"run.output_dir={json.dumps(str(out))}",
            f"run.name={name}"]
