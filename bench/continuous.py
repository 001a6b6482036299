"""A generator's decode loop on a long tail: chunk by chunk against continuous batching.

    python -m bench.continuous [--chunks 8] [--rows 64] [--repeats 3] [--tail long]

The policy is the SFT policy of `bench.longtail`'s task (trained and cached on first use),
sampling that task's prompts: most answers short, a tenth up to ~20x longer. Both ways
sample the same rows with the same keyed noise on one thread, so they produce the same
tokens (checked); reported per way: ms per chunk of `--rows` rows, completion tokens/s and
decode steps, and the load average. "chunk by chunk" is `generation.sample` on one chunk
after the other (a chunk ends with its longest answer; its finished rows leave the batch);
"continuous" is `engines.torch.continuous.ContinuousBatch` with every chunk queued and one
chunk's rows of slots (`generation.batch_slots = 0`), i.e. a generator that always has the
next chunk at hand. Writes bench/results/continuous.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench.longtail import TAILS, base_overrides, parse
from bench.output import write_json
from rlhf_async.config import load_config
from rlhf_async.engines.torch.continuous import ContinuousBatch
from rlhf_async.log import configure_logging
from rlhf_async.modeling.generation import Generated, sample, sampling_uniforms
from rlhf_async.task import SortDigitsTask, sampling_params
from rlhf_async.task.artefacts import load_sft, prepare_artefacts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.continuous",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="rows a chunk (prompts x 4)")
    ap.add_argument("--repeats", type=int, default=3, help="each way's median of this many")
    ap.add_argument("--tail", default="long", choices=list(TAILS))
    ap.add_argument("--out", default="bench/results/continuous.json")
    args = ap.parse_args(argv)
    configure_logging("warning")
    torch.set_num_threads(1)  # a generator node's share of a 2-core box
    cfg = load_config(None, base_overrides(parse(["--tail", args.tail]), 2))
    task = SortDigitsTask(cfg.task)
    policy = load_sft(prepare_artefacts(cfg, task).sft_dir).eval()
    params = sampling_params(cfg, task)
    R = params.max_new_tokens
    chunks = [task.prompt_batch(cfg.run.seed, "train", k, args.rows // 4, 4)
              for k in range(args.chunks)]
    noise = [sampling_uniforms(cfg.run.seed, k, c.sample_ids.tolist(), R)
             for k, c in enumerate(chunks)]

    def chunk_by_chunk() -> tuple[list[Generated], int]:
        got = [sample(policy, c.prompt_ids, c.prompt_mask, params, u)
               for c, u in zip(chunks, noise, strict=True)]
        return got, sum(int(g.response_mask.sum(1).max()) for g in got)  # the longest each

    def continuous() -> tuple[list[Generated], int]:
        batch = ContinuousBatch(policy, params, args.rows)
        for k, (c, u) in enumerate(zip(chunks, noise, strict=True)):
            batch.add(k, c, u)
        out: dict[int, Generated] = {}
        steps = 0
        while batch.busy:
            out.update(batch.step(0))
            steps += 1
        return [out[k] for k in range(len(chunks))], steps

    load_start = os.getloadavg()
    results: dict[str, dict] = {}
    tokens, lengths = {}, torch.zeros(0)
    for name, way in (("chunk by chunk", chunk_by_chunk), ("continuous", continuous)):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got, steps = way()
            times.append(time.perf_counter() - t0)
        tokens[name] = torch.cat([g.response_ids for g in got])
        lengths = torch.cat([g.response_mask.sum(1) for g in got]).float()
        n = int(sum(int(g.response_mask.sum()) for g in got))
        s = sorted(times)[len(times) // 2]
        results[name] = {"ms_per_chunk": 1e3 * s / args.chunks, "tokens_per_s": n / s,
                         "tokens": n, "decode_steps": steps, "seconds": times}
    same = torch.equal(tokens["chunk by chunk"], tokens["continuous"])
    load = os.getloadavg()
    print(f"{args.chunks} chunks x {args.rows} rows, answers {float(lengths.mean()):.1f} "
          f"tokens on average, longest {int(lengths.max())}; same tokens both ways: {same}")
    base = results["chunk by chunk"]["ms_per_chunk"]
    for name, r in results.items():
        print(f"{name:15s} {r['ms_per_chunk']:7.1f} ms/chunk {r['tokens_per_s']:8.0f} tokens/s "
              f"{r['decode_steps']:5d} decode steps {base / r['ms_per_chunk']:5.2f}x")
    print(f"load average {load_start[0]:.1f} at start, {load[0]:.1f} at end")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"args": vars(args), "same_tokens": same, "results": results,
                     "loadavg_start": load_start, "loadavg_end": load}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
