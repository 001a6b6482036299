"""LoRA adapters (peft, optional extra `[lora]`) on a trained model, and its merged weights.

Why in place (`peft.inject_adapter_in_model`), not a `PeftModel` wrapper: the actor stays
the HF causal LM that every role calls (`generate`, `response_logits`, `logits_to_keep`),
and a name changes only where an adapter sits: `<layer>.weight` becomes
`<layer>.base_layer.weight` beside `<layer>.lora_A.default.weight` and `lora_B`. Only the
adapters train; the base weights stay the SFT weights.

What leaves the trainer (the broadcast to generators, the final policy) is always
`merged_weights`: base + B @ A * alpha / rank under the base model's own names, so
generators, vLLM and `from_pretrained` see a plain model and never an adapter.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_async.config import ConfigError, LoraConfig
from rlhf_async.engines.extras import require_extra

ADAPTER = "default"  # peft's name for the one adapter a model gets here


def add_adapters(model: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """Adapters on `model`'s target layers, in place; every other parameter of `model` is
    frozen. lora_A is drawn from `seed` (every rank of a group draws the same), lora_B is 0,
    so the adapted model starts equal to the base."""
    require_extra("lora", "peft", "lora")
    import peft

    targets: str | list[str] = "all-linear" if cfg.target_modules == ["all-linear"] \
        else list(cfg.target_modules)
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=targets, bias="none")
    with torch.random.fork_rng(), warnings.catch_warnings():
        torch.manual_seed(seed)
        # GPT-2's Conv1D layers store W transposed; peft notices per layer and says so
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as e:  # e.g. a target that names no layer of this model
            raise ConfigError([f"lora.target_modules: {e}"]) from None
    return model


def _adapted_layers(model: nn.Module) -> dict[str, Any]:  # peft's LoraLayer (untyped)
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapters(model: nn.Module) -> bool:
    return bool(_adapted_layers(model))


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, Tensor]:
    """`model`'s state dict as the base model names it, each adapted layer's weight merged
    (peft's own `get_delta_weight`, i.e. what `merge_adapter` adds). The model itself is
    left as it is: merging in place and unmerging after would drift by rounding."""
    layers = _adapted_layers(model)
    out: dict[str, Tensor] = {}
    for key, t in model.state_dict().items():
        owner, sep, leaf = key.partition(".base_layer.")
        if sep and owner in layers:  # [out, in] (Conv1D: [in, out]), delta in that layout
            delta = layers[owner].get_delta_weight(ADAPTER) if leaf == "weight" else None
            out[f"{owner}.{leaf}"] = t + delta.to(t.dtype) if delta is not None else t
        elif key.split(".lora_", 1)[0] not in layers:  # not an adapter tensor
            out[key] = t.detach()
    return out


def trainable_names(model: nn.Module) -> set[str]:
    """State-dict names of the parameters that train (adapters, and a critic's head)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}
