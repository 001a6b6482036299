"""The two forward-pass choices of modeling/, timed both ways on the same inputs.

    .venv/bin/python -m bench.bench_forward [--model DIR] [--prompt 39] [--response 24]

1. CPU attention padding (`modeling/cpu_attention.py`): fwd + bwd of torch's causal SDPA
   at each length, padded to the next multiple of 16 against as it is (ratio < 1: padding
   wins), at two head shapes.
2. Shared prompts (`modeling/shared_prompts.py`): `response_logits` fwd + bwd of 4
   prompts x 4 responses, every row in full against each prompt once, for tiny GPT-2
   sizes and (with --model) a local HF model, in bf16 autocast. Prints the seconds and
   whether the rule would share.
3. bf16 attention (`modeling/cpu_attention.py`): `_cpu_sdpa` on bf16 inputs, written out
   (bf16 matmuls, fp32 softmax) against torch's kernel in fp32, forward alone and
   forward + backward, at the attention shapes of the benchmark models (and of --model).

One thread; prints the load average, which every number needs beside it.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

from rlhf_async.modeling import cpu_attention as attention
from rlhf_async.modeling import shared_prompts
from rlhf_async.modeling.cpu_attention import cpu_attention
from rlhf_async.modeling.models import disable_dropout, response_logits

LENGTHS = (14, 15, 17, 20, 27, 30, 31, 44, 47, 52, 56, 60, 63)


def best_of(fn: Callable[[], object], n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _attention(B: int, H: int, T: int, D: int) -> Callable[[], None]:
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def attention_padding() -> None:
    for B, H, D in ((32, 4, 16), (32, 6, 64)):
        ratios = []
        for T in LENGTHS:
            cost = [best_of(_attention(B, H, n, D), 15) for n in (T, T + (-T % 16))]
            ratios.append(f"{T}:{cost[1] / cost[0]:.2f}")
        print(f"attention {B}x{H}x{D} padded/as-is: " + " ".join(ratios))


def shared_vs_full(name: str, model: PreTrainedModel, P: int, R: int) -> None:
    model = disable_dropout(model).train()
    cpu_attention(model)
    V = model.config.vocab_size
    ids = torch.randint(5, V, (4, P)).repeat_interleave(4, 0)  # 4 prompts x 4 responses
    mask = torch.ones_like(ids)
    resp = torch.randint(5, V, (16, R))
    rmask = torch.ones_like(resp)

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16):
            logits = response_logits(model, ids, mask, resp, rmask).float()
        torch.log_softmax(logits, -1).gather(2, resp[..., None]).sum().backward()

    saved = shared_prompts.macs_per_token(model) * 12 * P  # 12 of 16 prompt rows
    bar_cpu = shared_prompts.MIN_SAVED_MACS["cpu"]
    times = {}
    for label, bar in (("full", float("inf")), ("shared", 0.0)):
        shared_prompts.MIN_SAVED_MACS = {"cpu": bar}
        times[label] = best_of(step, 3)
    shared_prompts.MIN_SAVED_MACS = {"cpu": bar_cpu}
    rule = "shares" if saved >= bar_cpu else "runs in full"
    print(f"shared prompts {name} ({P} + {R}): full {times['full']:.3f} s, shared "
          f"{times['shared']:.3f} s; {saved:.1e} multiply-adds saved: the rule {rule}")


class _Heads(torch.nn.Module):
    """What `_cpu_sdpa` reads off an HF attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def bf16_attention(name: str, B: int, H: int, Hkv: int, T: int, D: int) -> None:
    """`_cpu_sdpa` on bf16 [B, H, T, D] queries under a left-padding mask: written out
    against the kernel in fp32 (MAX_SCORES 0 turns the written-out form off)."""
    q = torch.randn(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)  # HF's layout
    k, v = (torch.randn(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
    mask = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    mask[: B // 2, :, :, :2] = False
    mask[..., 0] = True
    module = _Heads(H // Hkv)

    def run(grad: bool) -> Callable[[], None]:
        lq, lk, lv = (t.detach().requires_grad_(grad) for t in (q, k, v))

        def call() -> None:
            out, _ = attention._cpu_sdpa(module, lq, lk, lv, mask)
            if grad:
                out.float().sum().backward()
        return call

    cap = attention.MAX_SCORES
    times = {}
    for label, bar in (("kernel", 0), ("written", cap)):
        attention.MAX_SCORES = bar
        times[label] = [best_of(run(grad), 15) * 1e3 for grad in (False, True)]
    attention.MAX_SCORES = cap
    k_f, k_b = times["kernel"]
    w_f, w_b = times["written"]
    print(f"bf16 attention {name} [{B}, {H}/{Hkv}, {T}, {D}]: forward {k_f:.2f} -> {w_f:.2f} "
          f"ms, fwd + bwd {k_b:.2f} -> {w_b:.2f} ms (kernel in fp32 -> written out)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a local HF causal LM directory")
    ap.add_argument("--prompt", type=int, default=39, help="prompt tokens for --model")
    ap.add_argument("--response", type=int, default=24, help="response tokens for --model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}")
    attention_padding()
    for L, H, R in ((2, 64, 7), (4, 128, 7), (6, 384, 48)):
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=128, n_embd=H,
                                          n_layer=L, n_head=4))
        shared_vs_full(f"GPT-2 {L}x{H}", gpt2, 8, R)
    if args.model:
        lm = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        shared_vs_full(os.path.basename(args.model.rstrip("/")), lm, args.prompt,
                       args.response)
    for name, shape in (("GPT-2 4x128", (32, 4, 4, 15, 32)), ("GPT-2 6x384", (32, 6, 6, 57, 64)),
                        ("SmolLM2-135M", (16, 9, 3, 63, 64))):
        bf16_attention(name, *shape)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
