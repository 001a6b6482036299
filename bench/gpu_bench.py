"""Short engine benchmark for bench/gpu_check.sh; writes one JSON file.

    python bench/gpu_bench.py --out bench/results/gpu_check.json        # on a GPU
    python bench/gpu_bench.py --dry-run --out /tmp/gpu_check.json       # CPU, tiny sizes

Sections (each records its numbers or the reason it could not run, never aborts the rest):
- generation: tokens/s of our vLLM engine vs vLLM's AsyncLLM used directly, same prompts
  and sampling (bench/vllm_engine_tps.py); without vllm, our torch sampler alone.
- weight_sync: seconds to broadcast a ~1B-parameter state dict through our bucketed sender
  (NCCL between two GPUs when there are two; else gloo from GPU memory through the host).
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
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        base = [*size, "run.plot=false", "run.progress=false", "run.eval_prompts=16", "reward_model.heldout_pairs=64", "algo.group_size=2", f"run.output_dir={json.dumps(d)}", f"run.cache_dir={json.dumps(d + '/c')}", f"placement.device={device}"]
        for name, extra in (("flattening", []),
                            ("separation", ["placement.strategy=separation",
                                            "placement.devices=2", "algo.max_staleness=1"])):
            cfg = load_config(None, [*base, f"run.name={name}", *extra])
            summary = job.run(cfg)
            recs = read_metrics(Path(d) / name / "metrics.jsonl")
            steps = [r.get("time_step") or (r["time_generate"] + r["time_score"]
                                            + r["time_train"]) for r in recs]
            out[f"{name}_step_s"] = sum(steps) / max(1, len(steps))
            out[f"{name}_samples_per_s"] = summary["rl_samples_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    device = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda"
                           else "cpu", "dry_run": a.dry_run}
    for name, fn in (("generation", generation), ("weight_sync", weight_sync),
                     ("ppo_step", ppo_step)):
        res[name] = _section(name, fn, a.dry_run, device)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
