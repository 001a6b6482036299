"""One decode step (one new token per row) without Hugging Face's module tree.

At the sizes this project trains on a CPU, a decode step's time is mostly Python: a
token's forward through the HF model calls ~30 modules a layer, builds a 4-D attention
mask, dispatches attention through a registry and checks its arguments at every level,
while the arithmetic is a handful of small matmuls (bench/README.md: at 2x64, 1.5 ms a
token of which 0.7 ms in operators). `decode_step` returns a function that runs the same
arithmetic with the model's own parameters, on the KV cache of
`kv_cache.preallocated_cache` that the HF prefill filled: a few operators a layer and
nothing else. The parameters are looked up when the step is made (`sample` makes one per
call) and used as they are then: a weight update in place (a broadcast, an optimizer
step) is seen by the next token, a module given new parameter objects by the next call.
Attention for the one new query is two batched matmuls and a softmax, in the model's
dtype (torch's SDPA kernel costs ~1.5x as much for one query row on CPU), with grouped
query heads folded into rows of their key/value head.

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


def _mask_bias(mask: Tensor, dtype: torch.dtype, kv_heads: int) -> Tensor:
    """[b, T] 0/1 attention mask -> [b * kv_heads, 1, T] additive bias for `_attend`, made
    once a step for every layer."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias.masked_fill_(mask == 0, float("-inf"))
    return bias[:, None, :].repeat_interleave(kv_heads, dim=0)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, layer: Any, scale: float) -> Tensor:
    """Write this token's k, v [b, Hkv, 1, D] into the cache layer and attend over every
    cached position the mask bias [b * Hkv, 1, T] keeps. q [b, H, 1, D] -> [b, 1, H * D]."""
    keys, values = layer.update(k, v)  # [b, Hkv, T, D]
    b, H, _, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    qg = q.reshape(b * Hkv, H // Hkv, D)  # the query heads that share a key/value head
    # keys times queries, not queries times transposed keys: the cache's view of T of its
    # positions is then taken as it is, where a transposed one was copied at every call
    # in bf16 (bench/README.md, "Decode attention")
    scores = torch.bmm(keys.reshape(b * Hkv, T, D), qg.transpose(1, 2))  # [b * Hkv, T, G]
    scores = torch.add(bias, scores.transpose(1, 2), alpha=scale)  # [b * Hkv, G, T]
    out = torch.bmm(scores.softmax(dim=-1), values.reshape(b * Hkv, T, D))
    return out.view(b, 1, H * D)


def _gpt2_step(model: Any) -> DecodeStep:
    tr, config = model.transformer, model.config
    H, eps = config.n_head, config.layer_norm_epsilon
    gelu = _GELU[config.activation_function]
    wte, wpe, lm_head = tr.wte.weight, tr.wpe.weight, model.lm_head.weight
    ln_f = (tr.ln_f.weight, tr.ln_f.bias)
    blocks = [(blk.ln_1.weight, blk.ln_1.bias, blk.attn.c_attn.weight, blk.attn.c_attn.bias,
               blk.attn.c_proj.weight, blk.attn.c_proj.bias, blk.ln_2.weight, blk.ln_2.bias,
               blk.mlp.c_fc.weight, blk.mlp.c_fc.bias, blk.mlp.c_proj.weight,
               blk.mlp.c_proj.bias) for blk in tr.h]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        x = wte[tok[:, None]] + wpe[pos]  # [b, 1, E]
        b, E = x.shape[0], x.shape[-1]
        D = E // H
        bias = _mask_bias(mask, x.dtype, H)
        for (ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, fc_w, fc_b, pr_w, pr_b), \
                layer in zip(blocks, cache.layers, strict=True):
            h = F.layer_norm(x, (E,), ln1_w, ln1_b, eps)
            # Conv1D: x @ W + bias, W stored [in, out]
            qkv = torch.addmm(qkv_b, h.view(b, E), qkv_w)
            q, k, v = qkv.view(b, 3, H, 1, D).unbind(1)  # each [b, H, 1, D]
            a = _attend(q, k, v, bias, layer, D ** -0.5)
            x = x + torch.addmm(o_b, a.view(b, E), o_w).view(b, 1, E)
            h = F.layer_norm(x, (E,), ln2_w, ln2_b, eps)
            m = F.gelu(torch.addmm(fc_b, h.view(b, E), fc_w), approximate=gelu)
            x = x + torch.addmm(pr_b, m, pr_w).view(b, 1, E)
        x = F.layer_norm(x, (E,), ln_f[0], ln_f[1], eps)
        return F.linear(x.view(b, E), lm_head)  # [b, V]

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
    embed, norm = base.embed_tokens.weight, base.norm.weight
    head = (model.lm_head.weight, model.lm_head.bias)
    blocks = [(blk.input_layernorm.weight, blk.post_attention_layernorm.weight,
               blk.self_attn.scaling,
               *((lin.weight, lin.bias) for lin in (
                   blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj,
                   blk.self_attn.o_proj, blk.mlp.gate_proj, blk.mlp.up_proj,
                   blk.mlp.down_proj))) for blk in base.layers]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        x = embed[tok[:, None]]  # [b, 1, E]
        b = x.shape[0]
        cos, sin = base.rotary_emb(x, pos)  # [b, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, 1, D] over heads
        bias = _mask_bias(mask, x.dtype, Hkv)
        for (ln1, ln2, scaling, q_p, k_p, v_p, o_p, gate, up, down), layer in \
                zip(blocks, cache.layers, strict=True):
            h = _rms(x, ln1, eps)
            q = F.linear(h, *q_p).view(b, 1, H, D)
            k = F.linear(h, *k_p).view(b, 1, Hkv, D)
            v = F.linear(h, *v_p).view(b, 1, Hkv, D)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            a = _attend(q, k, v.transpose(1, 2), bias, layer, scaling)
            x = x + F.linear(a, *o_p)
            h = _rms(x, ln2, eps)
            x = x + F.linear(F.silu(F.linear(h, *gate)) * F.linear(h, *up), *down)
        x = _rms(x, norm, eps)
        return F.linear(x.view(b, -1), *head)  # [b, V]

    return step
