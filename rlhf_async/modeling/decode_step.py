"""One decode step (one new token per row) without Hugging Face's module tree.

At the sizes this project trains on a CPU, a decode step's time is mostly Python: a
token's forward through the HF model calls ~30 modules a layer, builds a 4-D attention
mask, dispatches attention through a registry and checks its arguments at every level,
while the arithmetic is a handful of small matmuls (bench/README.md: at 2x64, 1.5 ms a
token of which 0.7 ms in operators). `decode_step` returns a function that runs the same
arithmetic with the model's own parameters, read at every call (so a weight update or a
swap between steps is seen), on the KV cache of `kv_cache.preallocated_cache` that the
HF prefill filled: a few operators a layer and nothing else.

Only for the architectures written out below (GPT-2; Llama, Qwen2, Mistral), with plain
parameters, and only on a cache of full-attention buffer layers (sliding-window models
get no such cache, so they never reach this): anything else (another architecture, an
unusual config flag, a model wrapped by peft or DeepSpeed, ZeRO-3's partitioned
parameters) gets None, and the caller steps the HF model as before. The two paths give
the same logits to float rounding (tests/unit/modeling/test_decode_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (token ids [b], positions [b, 1], attention mask [b, T] over the cache plus this token,
#  the cache) -> logits [b, V]
DecodeStep = Callable[[Tensor, Tensor, Tensor, Any], Tensor]

_GPT2_FLAGS_OFF = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                   "add_cross_attention")
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def decode_step(model: nn.Module) -> DecodeStep | None:
    """The functional decode step for `model`, or None where it has none (see above)."""
    if type(model).__name__ not in ("GPT2LMHeadModel", "LlamaForCausalLM",
                                    "Qwen2ForCausalLM", "MistralForCausalLM"):
        return None  # peft and DeepSpeed wrappers land here too
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None  # ZeRO-3 gathers parameters in forward hooks we would skip
    if any(not type(m).__module__.startswith(("torch.", "transformers."))
           for m in model.modules()):
        return None  # e.g. LoRA layers injected in place, whose adapters we would skip
    config: Any = model.config
    if config.model_type == "gpt2":
        if any(getattr(config, f, False) for f in _GPT2_FLAGS_OFF) \
                or config.activation_function not in _GELU \
                or not getattr(config, "scale_attn_weights", True):
            return None
        return _gpt2_step(model)
    if config.model_type in ("llama", "qwen2", "mistral") \
            and getattr(config, "hidden_act", "silu") == "silu":
        return _llama_step(model)  # its own rotary module: every RoPE variant HF has
    return None


def _mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[b, T] 0/1 attention mask -> [b, 1, 1, T] additive bias, made once a step for every
    layer (a boolean mask is converted again inside each attention call)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask == 0, float("-inf"))[:, None, None, :]


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, layer: Any,
            scale: float | None = None) -> Tensor:
    """Write this token's k, v [b, Hkv, 1, D] into the cache layer and attend over every
    cached position the mask bias keeps. q [b, H, 1, D] -> [b, 1, H * D]."""
    keys, values = layer.update(k, v)  # [b, Hkv, T, D]
    gqa = q.shape[1] != keys.shape[1]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1)


def _gpt2_step(model: Any) -> DecodeStep:
    tr, config = model.transformer, model.config
    H, eps = config.n_head, config.layer_norm_epsilon
    gelu = _GELU[config.activation_function]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        x = tr.wte.weight[tok[:, None]] + tr.wpe.weight[pos]  # [b, 1, E]
        b, E = x.shape[0], x.shape[-1]
        bias: Tensor | None = None
        for block, layer in zip(tr.h, cache.layers, strict=True):
            h = F.layer_norm(x, (E,), block.ln_1.weight, block.ln_1.bias, eps)
            # Conv1D: x @ W + bias, W stored [in, out]
            qkv = torch.addmm(block.attn.c_attn.bias, h.view(b, E), block.attn.c_attn.weight)
            q, k, v = qkv.view(b, 3, H, 1, E // H).unbind(1)  # each [b, H, 1, D]
            bias = _mask_bias(mask, q.dtype) if bias is None else bias
            a = _attend(q, k, v, bias, layer)
            x = x + torch.addmm(block.attn.c_proj.bias, a.view(b, E),
                                block.attn.c_proj.weight).view(b, 1, E)
            h = F.layer_norm(x, (E,), block.ln_2.weight, block.ln_2.bias, eps)
            m = F.gelu(torch.addmm(block.mlp.c_fc.bias, h.view(b, E), block.mlp.c_fc.weight),
                       approximate=gelu)
            x = x + torch.addmm(block.mlp.c_proj.bias, m, block.mlp.c_proj.weight).view(b, 1, E)
        x = F.layer_norm(x, (E,), tr.ln_f.weight, tr.ln_f.bias, eps)
        return F.linear(x.view(b, E), model.lm_head.weight)  # [b, V]

    return step


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Llama computes it: in fp32, the scale applied in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _llama_step(model: Any) -> DecodeStep:
    base, config = model.model, model.config
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    eps = config.rms_norm_eps

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        x = base.embed_tokens.weight[tok[:, None]]  # [b, 1, E]
        b = x.shape[0]
        cos, sin = base.rotary_emb(x, pos)  # [b, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, 1, D] over heads
        bias: Tensor | None = None
        for block, layer in zip(base.layers, cache.layers, strict=True):
            attn = block.self_attn
            h = _rms(x, block.input_layernorm.weight, eps)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(b, 1, H, D)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(b, 1, Hkv, D)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(b, 1, Hkv, D)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            bias = _mask_bias(mask, q.dtype) if bias is None else bias
            a = _attend(q, k, v.transpose(1, 2), bias, layer, attn.scaling)
            x = x + F.linear(a, attn.o_proj.weight, attn.o_proj.bias)
            h = _rms(x, block.post_attention_layernorm.weight, eps)
            mlp = block.mlp
            m = F.silu(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) \
                * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(m, mlp.down_proj.weight, mlp.down_proj.bias)
        x = _rms(x, base.norm.weight, eps)
        return F.linear(x.view(b, -1), model.lm_head.weight, model.lm_head.bias)  # [b, V]

    return step
