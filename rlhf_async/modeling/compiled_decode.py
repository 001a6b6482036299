"""The decode step compiled: the whole step one torch.compile graph (inductor).

`decode_step`'s eager step launches ~15 small operators a layer from Python; at the sizes
this project trains on a CPU most of a step is their fixed cost, not arithmetic. Here the
step's arithmetic (embedding, every layer's norms, projections, attention over the cached
positions and this token, MLP, residuals; the head) is a pure function of tensors, weights
included, compiled once per process for every model of an architecture (`_compiled`: the
weights are inputs, so one graph serves any model of the same depth; `dynamic=True`: rows
and cache length vary without recompiling). The new keys and values come back out of the
graph and are written into the
preallocated cache by its own `update` (a write into a graph input would copy the whole
buffer back), and the new token attends to them as a second softmax block beside the
cached positions, the same arithmetic as attending over the cache with it written.

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
from rlhf_async.modeling.decode_step import _GELU, DecodeStep, decode_step

log = get_logger(component="decode")

# decode steps (rows x tokens do not matter: a step's saving is per call) this process must
# expect to run before compiling pays for its warm-up
COMPILE_MIN_STEPS = 20_000
BACKEND = "inductor"  # torch.compile's backend (tests trace with a fast one)
_GRAPHS: dict[str, Callable[..., Any]] = {}  # architecture -> its compiled layer
_FAILED: set[str] = set()


_ENABLED = [False]  # this process's choice (`choose`)


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
    _ENABLED[0] = on
    log.info("decode step", compiled=on, why=why)
    return on


def compiling() -> bool:
    """Whether this process chose the compiled step (`choose`)."""
    return _ENABLED[0]


def step_for(model: nn.Module, steps: int = 0) -> DecodeStep | None:
    """The decode step this process uses: compiled where `choose` said so, else eager."""
    return compiled_decode_step(model, steps) if _ENABLED[0] else decode_step(model, steps)


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


def _gpt2_forward(tok: Tensor, pos: Tensor, mask: Tensor, keys: list[Tensor],
                  values: list[Tensor], blocks: list[list[Tensor]], outer: list[Tensor],
                  heads: int, eps: float, gelu: str,
                  ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One decode step of GPT-2 over the cached keys/values of every layer [b, H, T, D]:
    (logits [b, V], each layer's new k, v [b, H, 1, D]). `outer`: wte, wpe, ln_f's."""
    wte, wpe, lnf_w, lnf_b = outer
    x = wte[tok] + wpe[pos[:, 0]]  # [b, E]
    b_old, b_new = _bias(mask, x.dtype)
    new_k, new_v = [], []
    for w, k_cache, v_cache in zip(blocks, keys, values, strict=True):
        x, k, v = _gpt2_layer(x, b_old, b_new, k_cache, v_cache, w, heads, eps, gelu)
        new_k.append(k)
        new_v.append(v)
    x = F.layer_norm(x, (x.shape[-1],), lnf_w, lnf_b, eps)
    return F.linear(x, wte), new_k, new_v


def _compiled(arch: str, fn: Callable[..., Any]) -> Callable[..., Any] | None:
    if arch in _FAILED:
        return None
    if arch not in _GRAPHS:
        _GRAPHS[arch] = torch.compile(fn, backend=BACKEND, dynamic=True, fullgraph=True)
    return _GRAPHS[arch]


def _bias(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[b, T + 1] 0/1 mask -> additive biases of the cached positions [b, 1, 1, T] and of
    this token [b, 1, 1, 1]."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill(mask == 0, float("-inf"))
    return bias[:, None, None, :-1], bias[:, None, None, -1:]


def _gpt2_compiled(model: Any) -> DecodeStep | None:
    tr, config = model.transformer, model.config
    forward = _compiled("gpt2", _gpt2_forward)
    if forward is None or model.lm_head.weight is not tr.wte.weight:
        return None  # (an untied head: not written here)
    H, eps, gelu = config.n_head, config.layer_norm_epsilon, _GELU[config.activation_function]
    outer = [tr.wte.weight, tr.wpe.weight, tr.ln_f.weight, tr.ln_f.bias]
    blocks = [[blk.ln_1.weight, blk.ln_1.bias, blk.ln_2.weight, blk.ln_2.bias,
               blk.attn.c_attn.weight, blk.attn.c_attn.bias, blk.attn.c_proj.weight,
               blk.attn.c_proj.bias, blk.mlp.c_fc.weight, blk.mlp.c_fc.bias,
               blk.mlp.c_proj.weight, blk.mlp.c_proj.bias] for blk in tr.h]

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        layers = cache.layers
        logits, ks, vs = forward(tok, pos, mask, [la.keys for la in layers],
                                 [la.values for la in layers], blocks, outer, H, eps, gelu)
        for layer, k, v in zip(layers, ks, vs, strict=True):
            layer.update(k, v)  # the cache's own write: this token's column
        return logits  # [b, V]

    return step


def compiled_decode_step(model: nn.Module, steps: int = 0) -> DecodeStep | None:
    """The compiled decode step for `model` where one is written (GPT-2), else the eager
    `decode_step` (or None where that has none either). The first call compiles (or loads
    inductor's cached kernels); a failure there logs once and falls back to eager."""
    eager = decode_step(model, steps)
    if eager is None or getattr(model.config, "model_type", "") != "gpt2":
        return eager
    fast = _gpt2_compiled(model)
    if fast is None:
        return eager
    state = {"step": fast}

    def step(tok: Tensor, pos: Tensor, mask: Tensor, cache: Any) -> Tensor:
        if state["step"] is eager:
            return eager(tok, pos, mask, cache)
        try:
            return state["step"](tok, pos, mask, cache)
        except Exception as e:  # any compiler failure: the eager step instead
            _FAILED.add("gpt2")
            log.warning("decode step not compiled: eager instead", error=str(e)[:500])
  # nothing was written to the cache
            state["step"] = eager
            return eager(tok, pos, mask, cache)

    return step
