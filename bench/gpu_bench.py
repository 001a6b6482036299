"""Short engine benchmark for bench/gpu_check.sh; writes one JSON file.

    python bench/gpu_bench.py --out bench/results/gpu_check.json        # on a GPU
    python bench/gpu_bench.py --dry-run --out /tmp/gpu_check.json       # CPU, tiny sizes

Sections (each records its numbers or the reason it could not run, never aborts the rest):
- generation: tokens/s of our vLLM engine vs vLLM's AsyncLLM used directly, same prompts
  and sampling (bench/vllm_engine_tps.py); without vllm, our torch sampler alone.
- weight_sync: seconds to broadcast a ~1B-parameter state dict through our bucketed sender
  (NCCL between two GPUs when there are two; else gloo from GPU memory through the host).
- decode_rows: milliseconds per decode step against rows decoding together (SmolLM2 shape).
- delta: encode + decode seconds of a delta weight update of SmolLM2-135M's size.
- ppo_step: seconds per RL step of the built-in task, Flattening vs Separation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.output import write_json
from rlhf_async.config import ModelConfig, TaskConfig
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.models import load_actor
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask


def _section(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    out["section_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps({name: {k: v for k, v in out.items() if k != "trace"}}), flush=True)
    return out


def generation(dry: bool, device: str) -> dict[str, Any]:
    task = SortDigitsTask(TaskConfig())
    hidden, layers, n = (64, 2, 16) if dry else (1024, 8, 256)
    sp = SamplingParams(max_new_tokens=8 if dry else 64, eos_id=EOS, pad_id=PAD)
    cfg = ModelConfig(hidden=hidden, heads=hidden // 64, layers=layers, max_positions=128)
    actor = load_actor(cfg, VOCAB_SIZE, task.special, seed=0).eval()
    prompts = task.prompt_batch(0, "eval", 0, n, 1)
    out: dict[str, Any] = {"prompts": n, "hidden": hidden, "layers": layers}
    if importlib.util.find_spec("vllm") is None:
        from rlhf_async.modeling.generation import generate

        actor = actor.to(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            b = generate(actor, prompts.to(device), sp, 0, 0, 0)
        out["torch_tokens_per_s"] = float(b.response_mask.sum()) / (time.perf_counter() - t0)
        out["vllm"] = "not installed"
        return out
    # our VLLMEngine against AsyncLLM driven directly, same prompts and sampling
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "tps.json"
        p = subprocess.run([sys.executable, "bench/vllm_engine_tps.py", "--out", str(res),
                            *(["--requests", "8", "--tokens", "16"] if dry else [])],
                           capture_output=True, text=True, timeout=900, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"bench/vllm_engine_tps.py failed: {p.stderr[-2000:]}")
        out.update(json.loads(res.read_text()))
    return out


def _recv(spec: dict, device: str, q: Any) -> None:
    from rlhf_async.weight_sync import GroupSpec, make_receiver

    gspec = GroupSpec.from_dict(spec)
    r = make_receiver(gspec.backend, device=device)
    r.connect(gspec, 1)
    plan = q.get()
    r.receive(plan)
    r.close()


def weight_sync(dry: bool, device: str) -> dict[str, Any]:
    from rlhf_async.weight_sync import GroupSpec, make_sender

    n_params = 2_000_000 if dry else 1_000_000_000
    dtype = torch.float32 if dry else torch.bfloat16
    two = torch.cuda.device_count() >= 2
    backend = "nccl" if two else "gloo"
    src = "cuda:0" if device == "cuda" else "cpu"
    per = n_params // 64
    weights = {f"layer{i}.weight": torch.randn(per, dtype=dtype, device=src) for i in range(64)}
    if backend == "gloo":
        t0 = time.perf_counter()
        weights = {k: v.cpu() for k, v in weights.items()}  # one GPU: through the host
        d2h = time.perf_counter() - t0
    sender = make_sender(backend, device=src if backend == "nccl" else "cpu", bucket_mb=100)
    spec = sender.prepare(GroupSpec(backend=backend, master_addr="127.0.0.1", master_port=0,
                                    world_size=2, name="bench", timeout_s=300.0))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_recv, args=(spec.to_dict(), "cuda:1" if two else "cpu", q))
    p.start()
    sender.connect(spec)
    plan = sender.plan(weights, 1)
    q.put(plan)
    t0 = time.perf_counter()
    sender.send(weights, plan)
    secs = time.perf_counter() - t0
    p.join(120)
    sender.close()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    out = {"backend": backend, "params": n_params, "bytes": nbytes, "broadcast_s": secs,
           "GB_per_s": nbytes / secs / 1e9}
    if backend == "gloo":
        out["device_to_host_s"] = d2h if device == "cuda" else 0.0
    return out


def ppo_step(dry: bool, device: str) -> dict[str, Any]:
    from rlhf_async import job
    from rlhf_async.config import load_config
    from rlhf_async.metrics import read_metrics

    size = (["model.hidden=32", "model.layers=1", "model.heads=2", "sft.steps=20",
             "reward_model.steps=20", "train.steps=3", "train.prompts_per_step=8"] if dry else
            ["model.hidden=512", "model.layers=8", "model.heads=8", "sft.steps=50",
             "reward_model.steps=50", "train.steps=6", "train.prompts_per_step=64"])
    # one GPU: the trainer and the generator share it and sync through gloo (NCCL refuses)
    gpus = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    out: dict[str, Any] = {"separation_devices": gpus}
    with tempfile.TemporaryDirectory() as d:
        base = [*size, "run.plot=false", "run.progress=false", "run.eval_prompts=16", "reward_model.heldout_pairs=64", "algo.group_size=2", f"run.output_dir={json.dumps(d)}", f"run.cache_dir={json.dumps(d + '/c')}", f"placement.device={device}"]
        for name, extra in (("flattening", []),
                            ("separation", ["placement.strategy=separation",
                                            f"placement.devices={gpus}",
                                            "algo.max_staleness=1"])):
            cfg = load_config(None, [*base, f"run.name={name}", *extra])
            summary = job.run(cfg)
            recs = read_metrics(Path(d) / name / "metrics.jsonl")
            steps = [r.get("time_step") or (r["time_generate"] + r["time_score"]
                                            + r["time_train"]) for r in recs]
            out[f"{name}_step_s"] = sum(steps) / max(1, len(steps))
            out[f"{name}_samples_per_s"] = summary["rl_samples_per_s"]
    return out


def decode_rows(dry: bool, device: str) -> dict[str, Any]:
    """Milliseconds per decode step against the rows decoding together (SmolLM2-135M's
    shape, random weights, bf16 on a GPU): flat in rows is where continuous batching and
    partial rollouts pay."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_async.modeling.generation import sample

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=512) if dry else
             dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        **shape, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=2)).to(device, torch.float32 if dry else torch.bfloat16)
    tokens, prompt = (8, 8) if dry else (128, 64)
    sp = SamplingParams(max_new_tokens=tokens, eos_id=1, pad_id=0, min_new_tokens=tokens - 1)
    out: dict[str, Any] = {"new_tokens": tokens, "prompt_tokens": prompt, "rows": {}}
    for rows in ((1, 4) if dry else (1, 16, 64, 256, 512)):
        ids = torch.randint(3, shape["vocab_size"], (rows, prompt), device=device)
        u = torch.rand(rows, tokens, dtype=torch.float64, device=device)
        times = []
        for _ in range(1 if dry else 3):
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                sample(model, ids, torch.ones_like(ids), sp, u)
            _sync(device)
            times.append(time.perf_counter() - t0)
        best = min(times)
        out["rows"][str(rows)] = {"ms_per_step": best / tokens * 1e3,
                                  "tokens_per_s": rows * tokens / best}
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def delta(dry: bool, device: str) -> dict[str, Any]:
    """Encode + decode seconds of a delta weight update of SmolLM2-135M's size (bf16 words):
    a share of the words changed, four in five of those by one unit in the last place (as
    in GRPO on the real model, bench/README.md) and the rest rewritten."""
    from rlhf_async.weight_sync import delta as codec

    n = 1 << 20 if dry else 134_515_008  # SmolLM2-135M's parameters, tied weights once
    g = torch.Generator(device=device).manual_seed(0)
    prev = torch.randn(n, generator=g, device=device).to(torch.bfloat16).view(torch.uint8)
    out: dict[str, Any] = {"full_bytes": prev.numel()}
    for share in (0.06, 0.3):
        new = prev.clone()
        w = codec.words(new)
        r = torch.rand(n, generator=g, device=device)
        w[r < share * 0.4] += 1
        w[(r >= share * 0.4) & (r < share * 0.8)] -= 1
        w[(r >= share * 0.8) & (r < share)] ^= 0x0F0F
        for _ in range(2):  # the first pass warms the kernels
            _sync(device)
            t0 = time.perf_counter()
            kind, payload = codec.encode(prev, new)
            _sync(device)
            t1 = time.perf_counter()
            base = prev.clone()
            _sync(device)
            t2 = time.perf_counter()
            codec.decode(kind, payload, base)
            _sync(device)
            t3 = time.perf_counter()
        out[f"changed_{share}"] = {"kind": codec.KINDS[kind], "bytes": payload.numel(),
                                   "of_full": payload.numel() / prev.numel(),
                                   "encode_s": t1 - t0, "decode_s": t3 - t2,
                                   "bit_identical": bool(torch.equal(base, new))}
    return out


SECTIONS = {"generation": generation, "decode_rows": decode_rows, "delta": delta,
            "weight_sync": weight_sync, "ppo_step": ppo_step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS),
                    help="which to run (default: all)")
    a = ap.parse_args()
    device = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda"
                           else "cpu", "dry_run": a.dry_run}
    for name in a.sections:
        res[name] = _section(name, SECTIONS[name], a.dry_run, device)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(a.out), res, indent=1)
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
