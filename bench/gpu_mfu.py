"""Utilization sections of bench/gpu_check.sh; writes one JSON file.

    python bench/gpu_mfu.py --out bench/results/gpu_mfu.json          # on a GPU
    python bench/gpu_mfu.py --dry-run --out /tmp/gpu_mfu.json         # CPU, tiny sizes

Sections (each records its numbers or the reason it could not run, never aborts the rest):
- decode_compiled: ms per decode step against rows, our eager step vs the compiled one
  (`modeling/compiled_decode.py`: torch.compile/inductor; GPT-2 of SmolLM2-135M's width and
  depth, random weights, bf16 on a GPU); the compile's warm-up timed apart.
- mfu_builtin: `mfu/*` and tokens/s per device of the built-in job (Flattening, 4 steps),
  from its metrics.jsonl.
- mfu_smollm2: each stage of one GRPO-sized step on a SmolLM2-135M-shaped random model
  timed apart (generate: `sample`; score: one forward; train: forward + backward) and its
  model FLOPs (`modeling/flops.py`) over the device's peak (GPU data sheet, bf16).
- trl: `bench.trl_compare` with TRL's GRPOTrainer and ours on this device (TRL, datasets,
  dill, multiprocess from .whl/), completions/s side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from bench.gpu_bench import _section, _sync
from rlhf_async.modeling import generation
from rlhf_async.modeling.compiled_decode import compiled_decode_step
from rlhf_async.modeling.flops import (
    GPU_PEAKS,
    FlopShape,
    generate_flops,
    gpu_kind,
    measure_peak,
    sequence_flops,
    token_counts,
)
from rlhf_async.modeling.generation import SamplingParams, sample


def _peak(device: str, dtype: torch.dtype) -> float:
    if device == "cuda":
        kind = gpu_kind(torch.cuda.get_device_name(0)) or "H100"
        return GPU_PEAKS[kind]["bf16" if dtype == torch.bfloat16 else "fp32"]
    return measure_peak(dtype)


def _timed(fn: Any, device: str, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def decode_compiled(dry: bool, device: str) -> dict[str, Any]:
    dtype = torch.float32 if dry or device == "cpu" else torch.bfloat16
    layers, width, heads, vocab = (2, 64, 2, 512) if dry else (30, 576, 9, 49152)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=vocab, n_positions=512, n_embd=width, n_layer=layers, n_head=heads,
        activation_function="gelu_pytorch_tanh", pad_token_id=0, eos_token_id=1,
        bos_token_id=2)).to(device, dtype).eval()
    tokens, prompt = (8, 8) if dry else (128, 64)
    sp = SamplingParams(max_new_tokens=tokens, eos_id=1, pad_id=0, min_new_tokens=tokens - 1)
    out: dict[str, Any] = {"model": f"gpt2 {layers}x{width}", "dtype": str(dtype),
                           "new_tokens": tokens, "rows": {}}
    eager = generation.decode_step
    try:
        for rows in ((1, 4) if dry else (1, 16, 64, 256)):
            ids = torch.randint(3, vocab, (rows, prompt), device=device)
            u = torch.rand(rows, tokens, dtype=torch.float64, device=device)
            row: dict[str, Any] = {}
            for name, step in (("eager", eager), ("compiled", compiled_decode_step)):
                generation.decode_step = step
                with torch.no_grad():
                    t0 = time.perf_counter()
                    sample(model, ids, torch.ones_like(ids), sp, u)  # warm-up / compile
                    row[f"{name}_first_s"] = time.perf_counter() - t0
                    best, g = _timed(lambda ids=ids, u=u: sample(
                        model, ids, torch.ones_like(ids), sp, u), device, 1 if dry else 3)
                row[f"{name}_ms_per_step"] = best / tokens * 1e3
                row[f"{name}_tokens"] = g.response_ids
            row["tokens_equal"] = bool(torch.equal(row.pop("eager_tokens"),
                                                   row.pop("compiled_tokens")))
            out["rows"][str(rows)] = row
    finally:
        generation.decode_step = eager
    return out


def mfu_builtin(dry: bool, device: str) -> dict[str, Any]:
    from rlhf_async import job
    from rlhf_async.config import load_config
    from rlhf_async.metrics import read_metrics

    size = (["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
             "reward_model.steps=20", "train.prompts_per_step=8"] if dry else
            ["model.hidden=512", "model.layers=8", "model.heads=8", "sft.steps=50",
             "reward_model.steps=50", "train.prompts_per_step=64"])
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [*size, "train.steps=4", "run.plot=false", "run.progress=false",
                                 "run.eval_prompts=16", "reward_model.heldout_pairs=64",
                                 "algo.name=grpo", "generation.max_new_tokens=48",
                                 f"run.output_dir={json.dumps(d)}", "run.name=mfu",
                                 f"run.cache_dir={json.dumps(d + '/c')}",
                                 f"placement.device={device}"])
        job.run(cfg)
        recs = read_metrics(Path(d) / "mfu" / "metrics.jsonl")[1:]  # warm-up out
        peak = json.loads((Path(d) / "mfu" / "config.json").read_text())["placement"][
            "peak_flops"]
    keys = sorted({k for r in recs for k in r if k.startswith("mfu/")}
                  | {"tokens_per_s_per_device"})
    return {"peak_flops": peak, **{k: sum(r.get(k, 0.0) for r in recs) / len(recs)
                                   for k in keys}}


def mfu_smollm2(dry: bool, device: str) -> dict[str, Any]:
    dtype = torch.float32 if dry or device == "cpu" else torch.bfloat16
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=512) if dry else
             dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        **shape, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=2)).to(device, dtype)
    rows, prompt, tokens = (4, 8, 8) if dry else (64, 64, 128)
    ids = torch.randint(3, shape["vocab_size"], (rows, prompt), device=device)
    sp = SamplingParams(max_new_tokens=tokens, eos_id=1, pad_id=0, min_new_tokens=tokens - 1)
    u = torch.rand(rows, tokens, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        t_gen, g = _timed(lambda: sample(model, ids, torch.ones_like(ids), sp, u), device, 2)
        full = torch.cat([ids, g.response_ids], dim=1)
        t_score, _ = _timed(lambda: model(full).logits, device, 2)
    model.train()

    def train() -> None:
        model(full).logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
    t_train, _ = _timed(train, device, 2)
    c = {k: float(v.sum()) for k, v in token_counts(torch.ones_like(ids),
                                                   g.response_mask).items()}
    c["rows"] = float(rows)
    s = FlopShape.of_module(model)
    flops = {"generate": generate_flops(s, c),
             "score": sequence_flops(s, c, c["tokens/prompt"] + c["tokens/response"]),
             "train": 3 * sequence_flops(s, c, c["tokens/prompt"] + c["tokens/response"])}
    times = {"generate": t_gen, "score": t_score, "train": t_train}
    peak = _peak(device, dtype)
    return {"dtype": str(dtype), "rows": rows, "peak_flops": peak, "seconds": times,
            **{f"mfu/{k}": flops[k] / (times[k] * peak) for k in flops},
            "mfu/step": sum(flops.values()) / (sum(times.values()) * peak)}


def trl(dry: bool, device: str) -> dict[str, Any]:
    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl not installed (put its wheels in .whl/)"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "trl.json"
        args = ["--quick"] if dry else ["--size", "6x384", "--steps", "6", "--warmup", "1",
                                        "--new-tokens", "48"]
        p = subprocess.run([sys.executable, "-m", "bench.trl_compare", *args, "--cores", "1",
                            "--trl-threads", "1", "--only", "trl", "flattening",
                            "--out", str(out), f"placement.device={device}"],
                           capture_output=True, text=True, timeout=120, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"bench.trl_compare failed: {p.stderr[-2000:]}")
        res = json.loads(out.read_text())
    return {"results": res.get("results", res)}


# cheap first: a section the script's timeout cuts leaves the ones before it written
SECTIONS = {"mfu_smollm2": mfu_smollm2, "mfu_builtin": mfu_builtin,
            "decode_compiled": decode_compiled, "trl": trl}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    a = ap.parse_args()
    device = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda"
                           else "cpu", "dry_run": a.dry_run}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for name in a.sections:
        res[name] = _section(name, SECTIONS[name], a.dry_run, device)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
