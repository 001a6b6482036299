"""The decode step compiled: the whole step one torch.compile graph (inductor), for GPT-2
and Llama-shaped models (Llama, Qwen2, Mistral: SmolLM2).

`decode_step`'s eager step launches ~15 small operators a layer from Python; at the sizes
this project trains on a CPU most of a step is their fixed cost, not arithmetic. Here the
step's arithmetic (embedding, every layer's norms, projections, attention over the cached
positions and this token, MLP, residuals; the head) is a pure function of tensors, weights
included, compiled once per process for every model of an architecture and config
(`_compiled`: the weights are inputs, so one graph serves any model of the same depth and
head count; only rows and cache length are dynamic, `_vary`, so neither recompiles). The
new keys and values come back out of the graph and are written into the preallocated
cache by its own `update` (a write into a graph input would copy the whole buffer back),
and the new token attends to them as a second softmax block beside the cached positions,
the same arithmetic as attending over the cache with it written.

Whether to compile is the caller's (`compile_pays`: a warm-up of tens of seconds pays only
over many decode steps); anything that fails to compile falls back to the eager step, once
per process, logged. Inductor caches its kernels on disk, so a later process of the same
shapes compiles in seconds, and a fork server's children inherit a graph compiled before
the fork.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf_async.log import get_logger
from rlhf_async.modeling.decode_step import _GELU, DecodeStep, _rms, _rotate, decode_step

log = get_logger(component="decode")

# decode steps (rows x tokens do not matter: a step's saving is per call) this process must
# expect to run before compiling pays for its warm-up
COMPILE_MIN_STEPS = 20_000
# ... and, under auto, models of at most this many parameters: the step alone at 32 rows
# ran 1.6x eager's tokens/s at 0.8M (4x128), 1.15x at 10.7M (6x384, memory-bound) and 0.95x
# at SmolLM2-135M's shape, whose weights' reads are the step (bench/README.md)
COMPILE_MAX_PARAMS = 30_000_000
BACKEND = "inductor"  # torch.compile's backend (tests trace with a fast one)
# (architecture, its config's constants) -> the compiled step
_GRAPHS: dict[tuple[Any, ...], Callable[..., Any]] = {}
_FAILED: set[str] = set()


_ENABLED = [False]  # this process's choice (`choose`)
_SETTING = ["auto"]  # ... and the setting it came from (`on`: every model compiles)
_TOO_BIG: set[int] = set()  # models' sizes already logged as left eager


def compile_pays(device: torch.device, expected_steps: int, setting: str = "auto",
                 ) -> tuple[bool, str]:
    """Whether a process that will run about `expected_steps` decode steps should use the
    compiled step, and why: `setting` on/off decides; auto compiles on CPU from
    COMPILE_MIN_STEPS (the first compile of a shape costs ~30-250 s of gcc on a loaded
    2-core box, and saves ~0.5-20 ms a step)."""
    if setting != "auto":
        return setting == "on", f"generation.compile = {setting}"
    if device.type != "cpu":
        return False, "auto: compiled only on CPU in this build"
    pays = expected_steps >= COMPILE_MIN_STEPS
    return pays, (f"auto: ~{expected_steps} decode steps "
                  f"{'>=' if pays else '<'} {COMPILE_MIN_STEPS} that repay the warm-up")


def choose(device: torch.device, expected_steps: int, setting: str = "auto") -> bool:
    """Decide (and log) once per process whether `step_for` compiles."""
    on, why = compile_pays(device, expected_steps, setting)
    _ENABLED[0], _SETTING[0] = on, setting
    log.info("decode step", compiled=on, why=why)
    return on


def compiling() -> bool:
    """Whether this process chose the compiled step (`choose`)."""
    return _ENABLED[0]


def step_for(model: nn.Module, steps: int = 0) -> DecodeStep | None:
    """The decode step this process uses: compiled where `choose` said so, else eager."""
    return compiled_decode_step(model, steps) if _ENABLED[0] else decode_step(model, steps)


def _too_big(model: nn.Module) -> bool:
    """Under auto: whether `model` is past COMPILE_MAX_PARAMS, where compiling lost (logged
    once a size)."""
    n = sum(p.numel() for p in model.parameters())
    if _SETTING[0] == "on" or n <= COMPILE_MAX_PARAMS:
        return False
    if n not in _TOO_BIG:
        _TOO_BIG.add(n)
        log.info("decode step", compiled=False, why=f"auto: {n} parameters > "
                 f"{COMPILE_MAX_PARAMS}, where the compiled step no longer paid")
    return True


def _two_block_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor,
                         b_old: Tensor, b_new: Tensor, scale: float) -> Tensor:
    """Softmax attention of q [b, Hkv, G, D] over the cached keys/values [b, Hkv, T, D]
    (bias b_old [b, 1, 1, T]) and this token's k, v [b, Hkv, 1, D] (bias b_new [b, 1, 1, 1])
    -> [b, Hkv, G, D]."""
    s_old = torch.matmul(q, keys.transpose(2, 3)) * scale + b_old  # [b, Hkv, G, T]
    s_new = torch.matmul(q, k.transpose(2, 3)) * scale + b_new  # [b, Hkv, G, 1]
    m = torch.maximum(s_old.amax(-1, keepdim=True), s_new)
    p_old, p_new = (s_old - m).exp(), (s_new - m).exp()
    return (torch.matmul(p_old, values) + p_new * v) / (p_old.sum(-1, keepdim=True) + p_new)


def _gpt2_layer(x: Tensor, b_old: Tensor, b_new: Tensor, keys: Tensor, values: Tensor,
                w: list[Tensor], heads: int, eps: float, gelu: str,
                ) -> tuple[Tensor, Tensor, Tensor]:
    """One GPT-2 block on x [b, E] -> (x, this token's k, v [b, H, 1, D])."""
    ln1_w, ln1_b, ln2_w, ln2_b, qkv_w, qkv_b, o_w, o_b, fc_w, fc_b, pr_w, pr_b = w
    b, E = x.shape
    D = E // heads
    h = F.layer_norm(x, (E,), ln1_w, ln1_b, eps)
    q, k, v = torch.addmm(qkv_b, h, qkv_w).view(b, 3, heads, 1, D).unbind(1)
    a = _two_block_attention(q, k, v, keys, values, b_old, b_new, 1.0 / math.sqrt(D))
    x = x + torch.addmm(o_b, a.reshape(b, E), o_w)
    h = F.layer_norm(x, (E,), ln2_w, ln2_b, eps)
    x = x + torch.addmm(pr_b, F.gelu(torch.addmm(fc_b, h, fc_w), approximate=gelu), pr_w)
    return x, k, v


def _gpt2_forward(heads: int, eps: float, gelu: str) -> Callable[..., Any]:
    """One decode step of GPT-2 with `heads` heads over the cached keys/values of every
    layer, buffers [b, H, C, D] of which the first T = mask.shape[1] - 1 columns are
    filled: (tok, pos, mask, keys, values, blocks, outer) -> (logits [b, V],
    each layer's new k, v [b, H, 1, D]); `outer`: wte, wpe, ln_f's. The config's numbers
    are constants of the graph (closed over, not inputs): with them symbolic, inductor's
    kernels computed the head dim at run time and vectorized its tail with masks."""

    def forward(tok: Tensor, pos: Tensor, mask: Tensor, keys: list[Tensor],
                values: list[Tensor], blocks: list[list[Tensor]], outer: list[Tensor],
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        wte, wpe, lnf_w, lnf_b = outer
        x = wte[tok] + wpe[pos[:, 0]]  # [b, E]
        b_old, b_new = _bias(mask, x.dtype)
        T = mask.shape[1] - 1  # cached positions: the buffers' first T columns
        new_k, new_v = [], []
        for w, k_cache, v_cache in zip(blocks, keys, values, strict=True):
            x, k, v = _gpt2_layer(x, b_old, b_new, k_cache[:, :, :T], v_cache[:, :, :T], w,
                                  heads, eps, gelu)
            new_k.append(k)
            new_v.append(v)
        x = F.layer_norm(x, (x.shape[-1],), lnf_w, lnf_b, eps)
        return F.linear(x, wte), new_k, new_v

    return forward


def _compiled(key: tuple[Any, ...], make: Callable[[], Callable[..., Any]],
              ) -> Callable[..., Any] | None:
    """The compiled graph of `key` (architecture and config constants), made once a process
    (None after a failure of that architecture)."""
    if key[0] in _FAILED:
        return None
    if key not in _GRAPHS:
        # dynamic only where `_vary` marks (rows, cached positions): dynamic=True made every
        # dimension symbolic, the head count too, and inductor's kernels then computed the
        # head dim at run time and vectorized its tail with masks
        _GRAPHS[key] = torch.compile(make(), backend=BACKEND, dynamic=False, fullgraph=True,
                                     options=_inductor_options())
    return _GRAPHS[key]


def _inductor_options() -> dict[str, Any] | None:
    """Inductor's options for our graphs: the vector width its CPU kernels are generated for
    (`cpp.simdlen`), the width of the ISA this process picks (ATEN_CPU_CAPABILITY, else the
    CPU's best). Left unset (None), inductor's on-disk graph cache (shared by every process
    of a user: /tmp/torchinductor_$USER) keys a graph without it, so a process on AVX-512
    loaded Python code generated by an ATEN_CPU_CAPABILITY=avx2 process (loops stepping 8
    floats) and compiled its C++ with 16-float vectors: every full-vector store wrote 8
    floats past its buffer, the heap corruption of `generation.compile = on` beside a CI run
    under avx2; the other way round, kernels stepping 16 under avx2 filled half of each
    output. As an option the width is part of the cache key."""
    if BACKEND != "inductor":
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # (inductor: loaded only here)

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


def _vary(tok: Tensor, pos: Tensor, mask: Tensor, keys: list[Tensor], values: list[Tensor],
          ) -> None:
    """Mark the dimensions that change between calls dynamic: rows (finished ones leave) and
    cached positions (one more a step), so neither recompiles; the rest stay constants."""
    for t in (tok, pos, mask, *keys, *values):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in (mask, *keys, *values):
        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2 if t.dim() == 4 else 1)


def _bias(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[b, T + 1] 0/1 mask -> additive biases of the cached positions [b, 1, 1, T] and of
    this token [b, 1, 1, 1]."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill(mask == 0, float("-inf"))
    return bias[:, None, None, :-1], bias[:, None, None, -1:]


def _gpt2_compiled(model: Any) -> DecodeStep | None:
    tr, config = model.transformer, model.config
    if model.lm_head.weight is not tr.wte.weight:
        return None  # (an untied head: not written here)
    H, eps, gelu = config.n_head, config.layer_norm_epsilon, _GELU[config.activation_function]
    forward = _compiled(("gpt2", H, eps, gelu), lambda: _gpt2_forward(H, eps, gelu))
    if forward is None:
        return None
    outer = [tr.wte.weight, tr.wpe.weight, tr.ln_f.weight, tr.ln_f.bias]
    blocks = [[blk.ln_1.weight, blk.ln_1.bias, blk.ln_2.weight, blk.ln_2.bias,
               blk.attn.c_attn.weight, blk.attn.c_attn.bias, blk.attn.c_proj.weight,
               blk.attn.c_proj.bias, blk.mlp.c_fc.weight, blk.mlp.c_fc.bias,
               blk.mlp.c_proj.weight, blk.mlp.c_proj.bias] for blk in tr.h]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        layers = cache.layers
        # whole buffers, not views of their filled columns: a view's strides carry the
        # buffer's capacity, which a new call's prompt length changes (a recompile)
        keys = [la.key_buffer for la in layers]
        values = [la.value_buffer for la in layers]
        mask = mask.contiguous()  # (a view of the call's whole mask: the same reason)
        _vary(tok, pos, mask, keys, values)
        logits, ks, vs = forward(tok, pos, mask, keys, values, blocks, outer)
        for layer, k, v in zip(layers, ks, vs, strict=True):
            layer.update(k, v)  # the cache's own write: this token's column
        return logits  # [b, V]

    return step


LLAMA_LIKE = ("llama", "qwen2", "mistral")


def _llama_forward(heads: int, kv_heads: int, eps: float, scaling: float,
                   ) -> Callable[..., Any]:
    """One decode step of a Llama-shaped model (Llama, Qwen2, Mistral: RMSNorm, rotary
    q and k, grouped-query attention, SiLU-gated MLP), as `_gpt2_forward`: (tok, cos, sin
    [b, D] of this position, mask, keys, values, blocks, outer) -> (logits [b, V], each
    layer's new k, v [b, Hkv, 1, D]); `outer`: the embedding, final norm, head and its bias
    (None without one). The rotary tables come in from the model's own rotary module."""
    G = heads // kv_heads

    def forward(tok: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, keys: list[Tensor],
                values: list[Tensor], blocks: list[list[Any]], outer: list[Any],
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        embed, norm, head_w, head_b = outer
        x = embed[tok]  # [b, E]
        b, T = x.shape[0], mask.shape[1] - 1
        b_old, b_new = _bias(mask, x.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, D] over heads
        new_k, new_v = [], []
        for w, k_cache, v_cache in zip(blocks, keys, values, strict=True):
            ln1, ln2, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, g_w, g_b, u_w, u_b, d_w, d_b = w
            h = _rms(x, ln1, eps)
            q = _rotate(F.linear(h, q_w, q_b).view(b, heads, -1), cos, sin)
            D = q.shape[-1]
            k = _rotate(F.linear(h, k_w, k_b).view(b, kv_heads, D), cos, sin)[:, :, None]
            v = F.linear(h, v_w, v_b).view(b, kv_heads, 1, D)
            a = _two_block_attention(q.view(b, kv_heads, G, D), k, v, k_cache[:, :, :T],
                                     v_cache[:, :, :T], b_old, b_new, scaling)
            x = x + F.linear(a.reshape(b, heads * D), o_w, o_b)
            h = _rms(x, ln2, eps)
            x = x + F.linear(F.silu(F.linear(h, g_w, g_b)) * F.linear(h, u_w, u_b), d_w, d_b)
            new_k.append(k)
            new_v.append(v)
        return F.linear(_rms(x, norm, eps), head_w, head_b), new_k, new_v

    return forward


def _llama_compiled(model: Any) -> DecodeStep | None:
    base, config = model.model, model.config
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    eps, scaling = config.rms_norm_eps, base.layers[0].self_attn.scaling
    forward = _compiled((config.model_type, H, Hkv, eps, scaling),
                        lambda: _llama_forward(H, Hkv, eps, scaling))
    if forward is None:
        return None
    outer = [base.embed_tokens.weight, base.norm.weight, model.lm_head.weight,
             model.lm_head.bias]
    blocks = [[blk.input_layernorm.weight, blk.post_attention_layernorm.weight,
               *(t for lin in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj,
                               blk.self_attn.o_proj, blk.mlp.gate_proj, blk.mlp.up_proj,
                               blk.mlp.down_proj) for t in (lin.weight, lin.bias))]
              for blk in base.layers]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        layers = cache.layers
        keys = [la.key_buffer for la in layers]
        values = [la.value_buffer for la in layers]
        cos, sin = base.rotary_emb(outer[0][:1], pos)  # [b, 1, D]: the model's own RoPE
        cos, sin, mask = cos[:, 0], sin[:, 0], mask.contiguous()
        _vary(tok, cos, mask, keys, values)
        torch._dynamo.maybe_mark_dynamic(sin, 0)
        logits, ks, vs = forward(tok, cos, sin, mask, keys, values, blocks, outer)
        for layer, k, v in zip(layers, ks, vs, strict=True):
            layer.update(k, v)
        return logits

    return step


def compiled_decode_step(model: nn.Module, steps: int = 0) -> DecodeStep | None:
    """The compiled decode step for `model` where one is written (GPT-2, Llama-shaped),
    else the eager `decode_step` (or None where that has none either). The first call
    compiles (or loads inductor's cached kernels); a failure there logs once and falls back
    to eager."""
    arch = getattr(model.config, "model_type", "")
    if arch not in ("gpt2", *LLAMA_LIKE) or decode_step(model) is None or _too_big(model):
        return decode_step(model, steps)  # (unpacked above: only asking whether it has one)
    fast = _gpt2_compiled(model) if arch == "gpt2" else _llama_compiled(model)
    if fast is None:
        return decode_step(model, steps)
    # the eager step only once needed: it packs its weights (CPU), ~0.1 ms a weight at
    # every call, which the compiled step does not use
    fallback: list[DecodeStep] = []

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        if fallback:
            return fallback[0](tok, pos, mask, cache)
        try:
            return fast(tok, pos, mask, cache)
        except Exception as e:  # any compiler failure: the eager step instead
            _FAILED.add(arch)
            log.warning("decode step not compiled: eager instead", error=str(e)[:500])
            eager = decode_step(model, steps)  # nothing was written to the cache
            if eager is None:  # pragma: no cover - it had one above
                raise
            fallback.append(eager)
            return eager(tok, pos, mask, cache)

    return step
