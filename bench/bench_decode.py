"""Sampling with the functional decode step against stepping the HF model, side by side.

    python bench/bench_decode.py [--rounds 5] [--rows 16] [--new-tokens 49] [--compiled]

For each model size: `modeling.generation.sample` on the same prompts and uniforms, with
`decode_step` (the default) and with it turned off (every token through the model's own
forward), taking turns round by round on one thread. Prints the median milliseconds per
call of each, their ratio, whether the tokens are equal and the largest log-prob
difference, with the load average before and after (compare ratios from one run on an
idle box). `--compiled`: our eager step against the compiled one
(`modeling/compiled_decode.py`, GPT-2 sizes), its warm-up timed apart. `--step-only` (with
`--compiled`): the decode steps alone, eager against compiled, on the same prefilled cache and
the same fed tokens (no sampler between them): their tokens/s, and whether each step's argmax
tokens agree. Random weights are enough: the cost of a step does not depend on them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig

from rlhf_async.modeling import generation
from rlhf_async.modeling.compiled_decode import choose, compiled_decode_step
from rlhf_async.modeling.decode_step import decode_step
from rlhf_async.modeling.generation import SamplingParams

SIZES = {"gpt2 2x64": ("gpt2", 2, 64, 4), "gpt2 4x128": ("gpt2", 4, 128, 4),
         "gpt2 6x384": ("gpt2", 6, 384, 6), "llama 4x128": ("llama", 4, 128, 4),
         # SmolLM2-135M's shape (random weights: a step costs the same)
         "smollm2-135m": ("smollm2", 30, 576, 9)}
VOCAB, PAD, EOS = 16, 0, 1


def model_config(arch: str, layers: int, hidden: int, heads: int) -> PretrainedConfig:
    special = {"pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": 2}
    if arch == "smollm2":
        return LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=1536,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=3, max_position_embeddings=2048,
                           tie_word_embeddings=True, rope_theta=100000.0, **special)
    if arch == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=heads, max_position_embeddings=128, **special)
    return GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=hidden, n_layer=layers,
                      n_head=heads, activation_function="gelu_pytorch_tanh", **special)


def compare(name: str, rounds: int, rows: int, new_tokens: int, compiled: bool = False) -> dict:
    """HF forward vs our eager step; with `compiled`, our eager step vs the compiled one
    (its first call, compiling or loading inductor's cache, timed apart as warm-up)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(*SIZES[name])).eval()
    ids = torch.randint(3, VOCAB, (rows, 8))  # [B, P], a quarter of the rows left-padded
    mask = torch.ones_like(ids)
    mask[: rows // 4, :3], ids[: rows // 4, :3] = 0, PAD
    params = SamplingParams(max_new_tokens=new_tokens, eos_id=EOS, pad_id=PAD,
                            min_new_tokens=new_tokens - 1)
    uniforms = torch.rand(rows, new_tokens, dtype=torch.float64)
    own = generation.decode_step
    times: dict[str, list[float]] = {"hf": [], "step": []}
    cpu: dict[str, list[float]] = {"hf": [], "step": []}
    outs = {}
    first = ("hf", lambda model, most=0: None)
    warm = 0.0
    if compiled:  # "hf" is then the eager step, "step" the compiled one
        first, own = ("hf", own), compiled_decode_step
        generation.decode_step, t0 = own, time.perf_counter()
        generation.sample(model, ids, mask, params, uniforms)
        warm = time.perf_counter() - t0
    try:
        for _ in range(rounds):
            for path, pick in (first, ("step", own)):
                generation.decode_step = pick
                t0, c0 = time.perf_counter(), time.process_time()
                outs[path] = generation.sample(model, ids, mask, params, uniforms)
                times[path].append(time.perf_counter() - t0)
                cpu[path].append(time.process_time() - c0)
    finally:
        generation.decode_step = first[1] if compiled else own
    hf, step = (statistics.median(times[p]) for p in ("hf", "step"))
    hf_cpu, step_cpu = (statistics.median(cpu[p]) for p in ("hf", "step"))
    return {"model": name, "hf_ms": hf * 1e3, "step_ms": step * 1e3, "speedup": hf / step,
            "speedup_cpu": hf_cpu / step_cpu, "warmup_s": warm,
            "tokens_equal": torch.equal(outs["hf"].response_ids, outs["step"].response_ids),
            "logprob_max_diff": float((outs["hf"].logprobs - outs["step"].logprobs).abs().max())}


def _steps(model: torch.nn.Module, step: Any, ids: Tensor, mask: Tensor,
           feed: Tensor) -> tuple[float, float, Tensor]:
    """Prefill `ids` (untimed), then feed the tokens `feed` [b, R] one decode step each:
    (wall seconds of the steps, their CPU seconds, each step's argmax tokens [b, R]).
    On one thread the CPU seconds are what the load moves least: a shared box's other
    jobs take turns on the core, which wall time counts and CPU time does not."""
    B, P = ids.shape
    R = feed.shape[1]
    full = torch.cat([mask, torch.ones((B, R), dtype=mask.dtype)], dim=1)
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache, _, ours = generation.prefill(model, ids, mask, pos, P + R)
    assert ours, "the model got no preallocated cache"
    next_pos, argmax = pos[:, -1:] + 1, []
    t0, c0 = time.perf_counter(), time.process_time()
    for t in range(R):
        argmax.append(step(feed[:, t], next_pos, full[:, : P + t + 1], cache).argmax(-1))
        next_pos = next_pos + 1
    return time.perf_counter() - t0, time.process_time() - c0, torch.stack(argmax, dim=1)


@torch.no_grad()
def compare_steps(name: str, rounds: int, rows: int, new_tokens: int) -> dict:
    """The eager decode step against the compiled one alone, same prefill, same fed tokens;
    the compiled step's first call (compiling or loading inductor's cache) timed apart."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(*SIZES[name])).eval()
    ids = torch.randint(3, VOCAB, (rows, 8))
    mask = torch.ones_like(ids)
    mask[: rows // 4, :3], ids[: rows // 4, :3] = 0, PAD
    feed = torch.randint(3, VOCAB, (rows, new_tokens))
    steps = {"eager": decode_step(model, new_tokens),
             "compiled": compiled_decode_step(model, new_tokens)}
    t0 = time.perf_counter()
    _steps(model, steps["compiled"], ids, mask, feed[:, :2])
    warm = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
    tokens = {}
    for _ in range(rounds):
        for path, step in steps.items():
            seconds, cpu_seconds, tokens[path] = _steps(model, step, ids, mask, feed)
            times[path].append(seconds)
            cpu[path].append(cpu_seconds)
    eager, fast = (statistics.median(times[p]) for p in ("eager", "compiled"))
    eager_cpu, fast_cpu = (statistics.median(cpu[p]) for p in ("eager", "compiled"))
    n = rows * new_tokens
    return {"model": name, "eager_tok_s": n / eager, "compiled_tok_s": n / fast,
            "speedup": eager / fast, "eager_tok_cpu_s": n / eager_cpu,
            "compiled_tok_cpu_s": n / fast_cpu, "speedup_cpu": eager_cpu / fast_cpu,
            "warmup_s": warm,
            "tokens_equal": torch.equal(tokens["eager"], tokens["compiled"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=49)
    ap.add_argument("--only", nargs="*", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--compiled", action="store_true",
                    help="our eager step against the compiled one (GPT-2 sizes)")
    ap.add_argument("--step-only", action="store_true",
                    help="with --compiled: the decode steps alone, no sampler")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.compiled:  # every size, as generation.compile = on (auto leaves big ones eager)
        choose(torch.device("cpu"), 0, "on")
    if args.step_only:
        print(f"load average before {os.getloadavg()}; {args.rows} rows x {args.new_tokens} "
              f"fed tokens, steps alone, medians of {args.rounds} calls, one thread")
        print(f"{'model':<12} {'eager tok/s':>12} {'compiled tok/s':>15} {'speed-up':>9}  "
              f"{'by CPU time: eager':>18} {'compiled':>9} {'speed-up':>9}  argmax equal  "
              "warm-up s")
        for name in args.only:
            r = compare_steps(name, args.rounds, args.rows, args.new_tokens)
            print(f"{name:<12} {r['eager_tok_s']:>12.0f} {r['compiled_tok_s']:>15.0f} "
                  f"{r['speedup']:>8.2f}x  {r['eager_tok_cpu_s']:>18.0f} "
                  f"{r['compiled_tok_cpu_s']:>9.0f} {r['speedup_cpu']:>8.2f}x  "
                  f"{r['tokens_equal']!s:<12}  {r['warmup_s']:9.1f}")
        print(f"load average after {os.getloadavg()}")
        return
    print(f"load average before {os.getloadavg()[0]:.2f}; {args.rows} rows x "
          f"{args.new_tokens} new tokens, medians of {args.rounds} calls, one thread")
    a, b = ("eager step ms", "compiled ms") if args.compiled else \
        ("HF forward ms", "decode step ms")
    print(f"{'model':<12} {a:>14} {b:>15} {'speed-up':>9} {'by CPU time':>12}  tokens equal  "
          "log-prob max diff" + ("  warm-up s" if args.compiled else ""))
    for name in args.only:
        r = compare(name, args.rounds, args.rows, args.new_tokens, args.compiled)
        print(f"{name:<12} {r['hf_ms']:>14.1f} {r['step_ms']:>15.1f} {r['speedup']:>8.2f}x "
              f"{r['speedup_cpu']:>11.2f}x  "
              f"{r['tokens_equal']!s:<12}  {r['logprob_max_diff']:.1e}"
              + (f"  {r['warmup_s']:9.1f}" if args.compiled else ""))
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
