"""Model FLOPs of one RL step, stage by stage, and the utilization they give (MFU).

A forward pass over a row costs, per position, 2 FLOPs per dense weight of the trunk (every
matmul weight but the embeddings), 4 x layers x attention width per earlier position it
attends to (QK^T and AV), and where its logits or score are used, 2 FLOPs per head weight.
A backward pass costs twice its forward; recomputed activations (gradient checkpointing)
one forward more. These are *model* FLOPs: what the step needs, not what a padded or
recomputing kernel happens to execute (PaLM's MFU), so a faster implementation of the same
step shows as a higher utilization.

Per step, from the token counts the trainer's global metrics carry (`token_counts`):
generation is each row's prompt prefilled, then one decode forward per response token but
the last (whose logits are never needed); scoring is a forward of the reward model, the
reference and the teacher over every row's whole sequence; training is the learner's own
count (`train_flops`: its passes over actor and critic). MFU = FLOPs / (busy device-seconds
x the device's peak FLOP/s, `placement.peak_flops`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from rlhf_async.modeling.roofline import DEVICES

# dense peak FLOP/s per GPU kind and dtype (the data sheets of roofline.DEVICES, no sparsity);
# fp32 is the non-tensor-core rate (TF32 is off unless a user enables it)
GPU_PEAKS: dict[str, dict[str, float]] = {
    kind: {"bf16": d.flops, "fp16": d.flops, "fp32": d.fp32_flops} for kind, d in DEVICES.items()}
STAGES = ("generate", "score", "train")
# the global sums `token_counts` adds to a step's metrics
TOKEN_KEYS = ("tokens/prompt", "tokens/response", "tokens/decoded", "attn_pairs/prefill",
              "attn_pairs/decode", "attn_pairs/full")


def gpu_kind(device_name: str) -> str | None:
    """The GPU_PEAKS key of a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'H100')."""
    return next((k for k in GPU_PEAKS if k in device_name.upper()), None)


@dataclass(frozen=True)
class FlopShape:
    """What a forward costs per position: `dense` trunk weights, `head` weights (the LM
    head's vocab x hidden, or a scalar head's hidden), `layers` x `width` for attention."""

    dense: float
    head: float
    layers: int
    width: int

    @classmethod
    def of_module(cls, model: nn.Module) -> FlopShape:
        """An HF causal LM, or a `ScalarHeadModel` (its `trunk` + a scalar head); a module
        without an HF config counts its matrices as dense and no attention. Counted from
        the parameters (ZeRO-3 partitions report their full size as `ds_numel`)."""
        trunk: Any = getattr(model, "trunk", model)
        cfg = getattr(trunk, "config", None)
        out = trunk.get_output_embeddings() if hasattr(trunk, "get_output_embeddings") else None
        skip = {id(p) for m in trunk.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False)}
        if out is not None:
            skip |= {id(p) for p in out.parameters(recurse=False)}
        dense = float(sum(getattr(p, "ds_numel", p.numel()) for p in trunk.parameters()
                          if p.dim() >= 2 and id(p) not in skip))
        if cfg is None:
            return cls(dense, 0.0, 0, 0)
        hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        width = int(getattr(cfg, "head_dim", None) or hidden // heads) * heads
        head = float(cfg.vocab_size * hidden if trunk is model else hidden)
        return cls(dense, head, int(cfg.num_hidden_layers), width)

    def forward(self, tokens: float, pairs: float, headed: float) -> float:
        """FLOPs of forwards over `tokens` positions attending `pairs` (query, key) pairs,
        with the head applied at `headed` of them."""
        return 2 * self.dense * tokens + 4 * self.layers * self.width * pairs \
            + 2 * self.head * headed


def token_counts(prompt_mask: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Per row [B]: prompt and response tokens, the decode forwards (one per response token
    but the last), and the (query, key) pairs attention computes when prefilling the prompt,
    decoding the response and in one forward over the whole sequence (scoring, training).
    `response_mask`: nonzero on every real response token (the policy's and an episode's
    environment's)."""
    p = prompt_mask.sum(dim=1).double()
    r = (response_mask != 0).sum(dim=1).double()
    t = p + r
    prefill = p * (p + 1) / 2
    # decode forward j = 1..R-1 attends P + j positions
    d = (r - 1).clamp(min=0)
    decode = d * p + d * (d + 1) / 2
    return dict(zip(TOKEN_KEYS, (p, r, d, prefill, decode, t * (t + 1) / 2), strict=True))


def generate_flops(actor: FlopShape, c: Mapping[str, float]) -> float:
    """Prefill + decode of the step's rows (`c`: the summed `token_counts`)."""
    return actor.forward(c["tokens/prompt"] + c["tokens/decoded"],
                         c["attn_pairs/prefill"] + c["attn_pairs/decode"], c["tokens/response"])


def sequence_flops(shape: FlopShape, c: Mapping[str, float], headed: float) -> float:
    """One forward over every row's whole sequence, the head at `headed` positions."""
    return shape.forward(c["tokens/prompt"] + c["tokens/response"], c["attn_pairs/full"],
                         headed)


def train_passes(epochs: int, old_forward: bool, recompute: bool) -> float:
    """Forward-equivalents per row of one training step: a separate no-grad forward for the
    old log-probs (when the learner runs one), then per epoch forward + backward (2x) and
    the recomputed forward of gradient checkpointing."""
    return float(old_forward) + epochs * (3 + int(recompute))


def train_flops(actor: FlopShape, critic: FlopShape | None, passes: float,
                c: Mapping[str, float]) -> float:
    """The learner's FLOPs: `passes` over actor (and critic) on every row's sequence, their
    heads on the response tokens."""
    r = c["tokens/response"]
    return passes * sum(sequence_flops(s, c, r) for s in (actor, critic) if s is not None)


@dataclass(frozen=True)
class Utilization:
    """What turns a step record into utilization: the scoring models' shapes (the actor's
    shape generates; the learner counts its own training FLOPs into `flops/train`) and one
    device's peak FLOP/s. A shape of None: that model is not in the job."""

    actor: FlopShape
    reward: FlopShape | None
    reference: FlopShape | None
    teacher: FlopShape | None
    peak: float  # FLOP/s of one device in the compute dtype
    devices: int  # the job's devices: the step's wall time counts on all of them

    def flops(self, record: Mapping[str, float]) -> dict[str, float]:
        c = {**{k: float(record[k]) for k in TOKEN_KEYS}, "rows": float(record["samples"])}
        # the reward model's score is read at each row's last token, the others' log-probs
        # at every response token
        score = sum(sequence_flops(s, c, c["tokens/response"])
                    for s in (self.reference, self.teacher) if s is not None)
        if self.reward is not None:
            score += sequence_flops(self.reward, c, c["rows"])
        return {"generate": generate_flops(self.actor, c), "score": score,
                "train": float(record.get("flops/train", 0.0))}

    def of(self, record: Mapping[str, float], busy: Mapping[str, float]) -> dict[str, float]:
        """`mfu/<stage>` (stage FLOPs over its `busy` device-seconds at peak), `mfu/step`
        (every stage's FLOPs over the step's wall time on all the job's devices) and
        `tokens_per_s_per_device` (prompt + response tokens); {} for a record without
        token counts (a restored one) or without a peak."""
        if self.peak <= 0 or any(k not in record for k in TOKEN_KEYS):
            return {}
        f = self.flops(record)
        out = {f"mfu/{s}": f[s] / (busy[s] * self.peak) for s in STAGES if busy.get(s, 0) > 0}
        wall = float(record["time_step"]) * max(1, self.devices)
        out["mfu/step"] = sum(f.values()) / (wall * self.peak)
        out["tokens_per_s_per_device"] = (record["tokens/prompt"] + record["tokens/response"]) \
            / wall
        return out


def shape_or_none(model: nn.Module | None) -> FlopShape | None:
    return None if model is None else FlopShape.of_module(model)


def shape_of_dir(path: str | Path, lm: bool) -> FlopShape:
    """The shape of the model saved at `path` (its config.json, built on the meta device:
    no weights read): a causal LM (`lm`), else a trunk with a scalar head."""
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = (AutoModelForCausalLM if lm else AutoModel).from_config(cfg)
    shape = FlopShape.of_module(model)
    return shape if lm else dataclasses.replace(shape, head=float(cfg.hidden_size))


def measure_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                 ) -> float:
    """This process's matmul FLOP/s in `dtype` at its torch thread count: the best of
    repeated n x n products for about `seconds` (the best, as a loaded machine only ever
    makes one slower)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # first call: kernel selection, page faults
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best
