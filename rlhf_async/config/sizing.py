"""Defaults sized to the user's model (`model.path`): the learning rates.

The defaults in `schema.py` are tuned on the built-in model (a 2x64 GPT-2, ~105k
parameters). A real model trained at them moves far too fast: SmolLM2-135M at
`train.lr = 5e-4` collapsed after one step (KL 0 -> 37-70, every reply at the token limit)
where 1e-5 learned. So for `model.path`, each learning rate the user leaves unset is the
built-in's value scaled by sqrt(105k / N) for a model of N parameters (never above the
built-in's value), as peers' recipes shrink their learning rates with the model:

    N          train.lr   critic_lr  sft.lr   reward_model.lr   (peers' RL actor lr)
    135M       1.4e-5     2.8e-5     8.4e-5   2.8e-5            (here: 1e-5 .. 5e-5 learn)
    0.5B       7.3e-6     1.5e-5     4.4e-5   1.5e-5            (verl, TRL: 1e-6 .. 5e-6)
    7B         1.9e-6     3.9e-6     1.2e-5   3.9e-6            (verl, OpenRLHF: 5e-7 .. 1e-6)
    70B        6.1e-7     1.2e-6     3.7e-6   1.2e-6            (OpenRLHF: 5e-7)

Anchored on the built-in model, the square root is the exponent that fits those recipes
from 0.5B to 70B and gives 135M the ~1e-5 measured to learn there (N^-1/3, muP's width rule
with depth ~ width, gives 7B 1.2e-5 and 70B 5.7e-6, ten times every recipe). LoRA
trains at 10x full fine-tuning's rate ("LoRA Without Regret", Schulman et al. 2025).

An explicit value (file or override) always wins; what was sized, and from what, is in
the dry run's report and the run's log (`sized_defaults`), and its value in config.json.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_async.config.schema import JobConfig

BUILTIN_PARAMETERS = 105_216  # the built-in 2x64 GPT-2 on sort_digits' 16-token vocabulary
LORA_FACTOR = 10.0
# the keys sized; each one's built-in value is the schema's default
SIZED_KEYS = (("train", "lr"), ("train", "critic_lr"), ("sft", "lr"), ("reward_model", "lr"))


@dataclass(frozen=True)
class Sized:
    """One default sized to the model: `key` (dotted) = `value`, and why."""

    key: str
    value: float
    basis: str


def parameter_count(model_dir: str | Path) -> int | None:
    """Parameters of the HF model in `model_dir`: exact from its safetensors headers
    (tied weights are stored once), else estimated from its config.json; None when neither
    can be read."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if files:
        try:
            return sum(_safetensors_count(f) for f in files)
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            pass
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _estimate(hf) if isinstance(hf, dict) else None


def _safetensors_count(path: Path) -> int:
    """Elements of every tensor in one safetensors file, read from its JSON header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _estimate(hf: dict[str, Any]) -> int | None:
    """A decoder's parameters from its HF config (attention with grouped KV heads, a gated
    or plain MLP, the embedding once when tied); None without a hidden size."""
    h = int(hf.get("hidden_size", hf.get("n_embd", 0)) or 0)
    layers = int(hf.get("num_hidden_layers", hf.get("n_layer", 0)) or 0)
    if not h or not layers:
        return None
    heads = int(hf.get("num_attention_heads", hf.get("n_head", 1)) or 1)
    kv = int(hf.get("num_key_value_heads", heads) or heads)
    head_dim = int(hf.get("head_dim", h // heads) or h // heads)
    inter = int(hf.get("intermediate_size", hf.get("n_inner") or 4 * h) or 4 * h)
    mlp = (3 if "intermediate_size" in hf else 2) * h * inter
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    tied = hf.get("tie_word_embeddings", True)
    return layers * (attn + mlp) + int(hf.get("vocab_size", 0)) * h * (1 if tied else 2)


def lr_scale(parameters: int) -> float:
    """The factor on the built-in model's learning rates for a model of `parameters`."""
    return min(1.0, math.sqrt(BUILTIN_PARAMETERS / max(1, parameters)))


def _round(x: float) -> float:
    return float(f"{x:.2g}")


def model_defaults(cfg: JobConfig) -> list[Sized]:
    """The sized value of each of `SIZED_KEYS` for `cfg`'s model.path; [] for the built-in
    model, or when the model's size cannot be read (the path checks say why)."""
    n = parameter_count(cfg.model.path) if cfg.model.path else None
    if n is None:
        return []
    scale = lr_scale(n)
    # sft and rm train every weight; RL trains LoRA adapters where lora.rank says so
    lora = {"train.lr": cfg.lora.rank > 0,
            "train.critic_lr": cfg.lora.rank > 0 and cfg.lora.critic}
    out = []
    for section, key in SIZED_KEYS:
        default = getattr(type(getattr(cfg, section))(), key)
        basis = f"{default:g} x {scale:.3g}"
        factor = scale
        if lora.get(f"{section}.{key}"):
            factor, basis = scale * LORA_FACTOR, f"{basis} x {LORA_FACTOR:g} (LoRA)"
        out.append(Sized(f"{section}.{key}", _round(min(default, default * factor)), basis))
    return out


def apply_model_defaults(cfg: JobConfig, given: set[str]) -> list[Sized]:
    """Set each sized default of `cfg` whose dotted key is not in `given` (what the file
    and the overrides set); returns those set."""
    applied = [s for s in model_defaults(cfg) if s.key not in given]
    for s in applied:
        section, key = s.key.split(".")
        setattr(getattr(cfg, section), key, s.value)
    return applied


def describe_sized(cfg: JobConfig) -> str:
    """The sized keys of `cfg` with their values and where each came from, as text ('' for
    the built-in model)."""
    sized = model_defaults(cfg)
    if not sized:
        return ""
    n = parameter_count(cfg.model.path) or 0
    lines = [f"learning rates for model.path ({n / 1e6:.1f}M parameters; the built-in "
             f"model's scaled by sqrt({BUILTIN_PARAMETERS} / parameters), config/sizing.py):"]
    for s in sized:
        section, key = s.key.split(".")
        value = getattr(getattr(cfg, section), key)
        origin = (f"sized to the model ({s.basis})" if value == s.value
                  else f"set in the config (sized would be {s.value:g})")
        lines.append(f"  {s.key} = {value:g}  {origin}")
    return "\n".join(lines) + "\n"
