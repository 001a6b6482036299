"""The models a client may name as `base_model`: the built-in tiny one, a local model
directory, or a hub id already in the local Hugging Face cache (nothing is downloaded).

The built-in `rlhf-async/tiny-gpt2` is made in code the first time it is asked for and
kept in the server's state directory: a byte-level tokenizer (any text, 256 byte tokens
and three specials, a ChatML-style chat template) and a seeded 2-layer GPT-2 of the size
the built-in task trains (`modeling.models.tiny_config`). It has learned nothing; it is
for trying the API offline and for tests. Its directory is its tokenizer id, so the
client's `get_tokenizer()` loads it from there (on the same machine or a shared disk).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from rlhf_async.config import ModelConfig
from rlhf_async.config.hub import HUB_ID, cached_snapshot, hub_cache
from rlhf_async.modeling.models import tiny_config
from rlhf_async.ops.tinker.futures import UserError

BUILTIN = "rlhf-async/tiny-gpt2"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
TINY = ModelConfig(hidden=64, layers=2, heads=4, max_positions=1024)


@dataclass(frozen=True)
class BaseModel:
    name: str  # as the client named it
    path: Path  # the local HF directory
    tokenizer_id: str  # what the client's AutoTokenizer.from_pretrained loads
    arch: str
    max_length: int  # positions the model takes


def byte_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   pad_token=SPECIALS[0], eos_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_builtin(out: Path) -> Path:
    """Write the built-in model to `out` once (atomically: a crash leaves no half)."""
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        tok = byte_tokenizer()
        tok.save_pretrained(tmp)
        ids = tok.get_vocab()
        cfg = tiny_config(TINY, len(tok), pad_id=ids[SPECIALS[0]], bos_id=ids[SPECIALS[0]],
                          eos_id=ids[SPECIALS[2]])
        with torch.random.fork_rng():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        os.replace(tmp, out)
    except FileExistsError:  # another process made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve(name: str, models_dir: Path) -> BaseModel:
    """`name` as a served model; UserError saying what is served when it is none."""
    if name == BUILTIN:
        path = make_builtin(models_dir / "tiny-gpt2")
        return _described(name, path, str(path))
    local = Path(name).expanduser()
    if local.is_dir():
        return _described(name, local.resolve(), str(local.resolve()))
    snapshot = cached_snapshot(name) if HUB_ID.match(name) else None
    if snapshot is not None:
        return _described(name, snapshot, name)
    raise UserError(f"unknown base_model {name!r}: this server serves {BUILTIN!r} (built in), "
                    "a local model directory, or a hub id already in the local Hugging Face "
                    f"cache ({hub_cache()}); nothing is downloaded")


def _described(name: str, path: Path, tokenizer_id: str) -> BaseModel:
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"base_model {name!r}: {path} is not a Hugging Face model directory "
                        f"({e})") from None
    length = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 0)
    return BaseModel(name, path, tokenizer_id, str(cfg.model_type), int(length or 0))
