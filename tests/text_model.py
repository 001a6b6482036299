"""A tiny word-level tokenizer + GPT-2 saved as a local HF directory, for text-task tests
(the built-in model has no tokenizer; nothing may come from a hub)."""

from __future__ import annotations

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
