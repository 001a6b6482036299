"""One decode step (one new token per row) without Hugging Face's module tree.

At the sizes this project trains on a CPU, a decode step's time is mostly Python: a
token's forward through the HF model calls ~30 modules a layer, builds a 4-D attention
mask, dispatches attention through a registry and checks its arguments at every level,
while the arithmetic is a handful of small matmuls (bench/README.md: at 2x64, 1.5 ms a
token of which 0.7 ms in operators). `decode_step` returns a function that runs the same
arithmetic with the model's own parameters, on the KV cache of
`kv_cache.preallocated_cache` that the HF prefill filled: a few operators a layer and
nothing else. The parameters are read when the step is made (`sample` makes one per call,
and weights change only between calls: a generator swaps them between generation steps,
Flattening trains after generating): a weight update is seen by the next call.

On CPU, for a call of at least PACK_MIN_STEPS decode steps, the step's matmul weights are
packed once, when it is made, into oneDNN's blocked layout (`_linear`): a small-batch
matmul otherwise re-packs its weight at every call. bf16 weights (20-45% a matmul), fp32
ones from PACK_MIN_FP32 elements (below it the packed call's fixed cost loses). Packing
costs ~0.1 ms a weight (37 ms for SmolLM2's 49152 x 576 head), paid again at every call
as weights change every RL step, so short generations keep the plain matmuls;
bench/README.md, "Packed decode weights".
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


PACK_MIN_STEPS = 16  # decode steps a call must run for its weights to be packed on CPU
PACK_MIN_FP32 = 1 << 16  # ... and fp32 weights of at least this many elements
BATCH_HINT = 32  # rows the packed layout is chosen for (any number of rows runs on it)
Linear = Callable[[Tensor], Tensor]


def _packs(weight: Tensor) -> bool:
    """Whether a decode step packs `weight` for oneDNN (see the module)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() \
            or torch.is_autocast_enabled("cpu"):
        return False  # under autocast the matmuls' dtype is autocast's, not the weight's
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32 and weight.numel() >= PACK_MIN_FP32


def _linear(weight: Tensor, bias: Tensor | None, pack: bool, conv1d: bool = False) -> Linear:
    """x [..., in] -> x @ W^T + bias for a weight [out, in] (nn.Linear's) or [in, out]
    (`conv1d`: GPT-2's Conv1D), with `pack` on a packed copy of the weight where that pays."""
    w = weight.t() if conv1d else weight  # [out, in]
    packed = _packed(w) if pack and _packs(w) else None
    if packed is None:
        return lambda x: F.linear(x, w, bias)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed(w: Tensor) -> Tensor | None:
    """`w` [out, in] in oneDNN's blocked layout; None on a build without that op."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), BATCH_HINT)
    except (RuntimeError, AttributeError):
        return None


def decode_step(model: nn.Module, steps: int = 0) -> DecodeStep | None:
    """The functional decode step for `model`, or None where it has none (see above);
    `steps`: how many decode steps the call will run at most (it packs from
    PACK_MIN_STEPS)."""
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
        return _gpt2_step(model, steps >= PACK_MIN_STEPS)
    if config.model_type in ("llama", "qwen2", "mistral") \
            and getattr(config, "hidden_act", "silu") == "silu":
        # its own rotary module: every RoPE variant HF has
        return _llama_step(model, steps >= PACK_MIN_STEPS)
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


def _gpt2_step(model: Any, pack: bool) -> DecodeStep:
    tr, config = model.transformer, model.config
    H, eps = config.n_head, config.layer_norm_epsilon
    gelu = _GELU[config.activation_function]
    wte, wpe, lm_head = tr.wte.weight, tr.wpe.weight, _linear(model.lm_head.weight, None, pack)
    ln_f = (tr.ln_f.weight, tr.ln_f.bias)
    blocks = [(blk.ln_1.weight, blk.ln_1.bias, blk.ln_2.weight, blk.ln_2.bias,
               *(_linear(c.weight, c.bias, pack, conv1d=True) for c in (
                   blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc, blk.mlp.c_proj)))
              for blk in tr.h]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        x = wte[tok[:, None]] + wpe[pos]  # [b, 1, E]
        b, E = x.shape[0], x.shape[-1]
        D = E // H
        bias = _mask_bias(mask, x.dtype, H)
        for (ln1_w, ln1_b, ln2_w, ln2_b, qkv_p, o_p, fc_p, pr_p), layer in \
                zip(blocks, cache.layers, strict=True):
            h = F.layer_norm(x, (E,), ln1_w, ln1_b, eps)
            qkv = qkv_p(h.view(b, E))
            q, k, v = qkv.view(b, 3, H, 1, D).unbind(1)  # each [b, H, 1, D]
            a = _attend(q, k, v, bias, layer, D ** -0.5)
            x = x + o_p(a.view(b, E)).view(b, 1, E)
            h = F.layer_norm(x, (E,), ln2_w, ln2_b, eps)
            x = x + pr_p(F.gelu(fc_p(h.view(b, E)), approximate=gelu)).view(b, 1, E)
        x = F.layer_norm(x, (E,), ln_f[0], ln_f[1], eps)
        return lm_head(x.view(b, E))  # [b, V]

    return step


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Llama computes it: in fp32, the scale applied in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _llama_step(model: Any, pack: bool) -> DecodeStep:
    base, config = model.model, model.config
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    eps = config.rms_norm_eps
    embed, norm = base.embed_tokens.weight, base.norm.weight
    head = _linear(model.lm_head.weight, model.lm_head.bias, pack)
    blocks = [(blk.input_layernorm.weight, blk.post_attention_layernorm.weight,
               blk.self_attn.scaling,
               *(_linear(lin.weight, lin.bias, pack) for lin in (
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
            q = q_p(h).view(b, 1, H, D)
            k = k_p(h).view(b, 1, Hkv, D)
            v = v_p(h).view(b, 1, Hkv, D)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            a = _attend(q, k, v.transpose(1, 2), bias, layer, scaling)
            x = x + o_p(a)
            h = _rms(x, ln2, eps)
            x = x + down(F.silu(gate(h)) * up(h))
        x = _rms(x, norm, eps)
        return head(x.view(b, -1))  # [b, V]

    return step
