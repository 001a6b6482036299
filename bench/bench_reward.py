"""Reward latency: the built-in task's rule in process against the same rule served by
`rlhf-async serve-reward` over loopback, per batch, and what the scorer's overlap hides.

    .venv/bin/python -m bench.bench_reward [--batches 200] [--rows 32]

1. `hidden_scores` of a batch of `--rows` responses (random tokens, the default task's
   prompts): the built-in score (on tokens), the text rule in process (`task.reward =
   "rlhf_async.task.sort_digits:rule"`) and served (a `serve-reward` process on 127.0.0.1,
   `task.reward = URL`): median and p90 ms per batch.
2. `score` (the scorer's role: the default model's reference forward, then the reward) of
   the same batches: in process; served and overlapped (the default for a URL); served, not
   overlapped (`RewardMix.overlap = False`); and the same two against a judge that takes
   20 ms a batch (`slow_rule`, served `--batched`).

One torch thread; prints the load average, which every number needs beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from rlhf_async.config import ModelConfig, TaskConfig
from rlhf_async.modeling.models import freeze, load_actor
from rlhf_async.modeling.rollout import RolloutBatch
from rlhf_async.rl.scoring import RewardMix, score
from rlhf_async.task.sort_digits import BOS, EOS, PAD, VOCAB_SIZE, SortDigitsTask, rule

REPO = Path(__file__).resolve().parents[1]
JUDGE_S = 0.020


def slow_rule(prompts: list[str], responses: list[str]) -> list[float]:
    """A stand-in for a judge model: 20 ms a batch, then the built-in rule."""
    time.sleep(JUDGE_S)
    return [rule(p, r) for p, r in zip(prompts, responses, strict=True)]


@contextmanager
def served(spec: str, *flags: str) -> Iterator[str]:
    """A `rlhf-async serve-reward` process on a free port of 127.0.0.1: its URL."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_async", "serve-reward", spec,
                             "--port", "0", *flags], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
        assert proc.stdout is not None
        found = re.search(r"at (http://\S+) ", proc.stdout.readline())
        assert found, "serve-reward did not start"
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def batches(task: SortDigitsTask, n: int, rows: int) -> list[RolloutBatch]:
    out = []
    for step in range(n):
        p = task.prompt_batch(0, "train", step, rows, 1)
        g = torch.Generator().manual_seed(step)
        resp = torch.randint(4, 14, (rows, task.response_len), generator=g)
        resp[:, -1] = EOS
        mask = torch.ones_like(resp)
        out.append(RolloutBatch(p.prompt_ids, p.prompt_mask, resp, mask,
                                torch.zeros(resp.shape), p.sample_ids, p.group_ids))
    return out


def timed(variants: dict[str, Callable[[RolloutBatch], object]],
          data: list[RolloutBatch]) -> None:
    """Print median and p90 ms per batch of each variant; they take turns batch by batch,
    so background load hits them alike."""
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn(data[0])  # warm: imports, first connection, allocator
    for b in data:
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(b)
            ms[name].append((time.perf_counter() - t0) * 1e3)
    for name, times in ms.items():
        times.sort()
        print(f"{name:<40} {statistics.median(times):7.2f} {times[int(0.9 * len(times))]:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--rows", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain = SortDigitsTask(TaskConfig())
    data = batches(plain, args.batches, args.rows)
    in_proc = SortDigitsTask(TaskConfig(reward="rlhf_async.task.sort_digits:rule"))
    reference = freeze(load_actor(ModelConfig(), VOCAB_SIZE, (PAD, BOS, EOS), 0))
    print(f"load average before: {os.getloadavg()}; {args.batches} batches of {args.rows}")
    print(f"{'what':<40} {'median':>7} {'p90':>7}  (ms per batch)")
    with served("rlhf_async.task.sort_digits:rule") as url, \
            served("bench.bench_reward:slow_rule", "--batched") as slow_url:
        remote = SortDigitsTask(TaskConfig(reward=url))
        judge = SortDigitsTask(TaskConfig(reward=slow_url))
        timed({name: (lambda b, t=task: t.hidden_scores(b.prompt_ids, b.response_ids,
                                                          b.response_mask))
               for name, task in (("hidden_scores, built in (tokens)", plain),
                                  ("hidden_scores, text rule in process", in_proc),
                                  ("hidden_scores, served over loopback", remote),
                                  ("hidden_scores, served 20 ms judge", judge))}, data)
        slow = RewardMix(judge.hidden_scores, overlap=True)
        mixes = {"score, rule in process": RewardMix(in_proc.hidden_scores),
                 "score, served, overlapped": RewardMix(remote.hidden_scores, overlap=True),
                 "score, served, not overlapped": RewardMix(remote.hidden_scores),
                 "score, 20 ms judge, overlapped": slow,
                 "score, 20 ms judge, not overlapped": replace(slow, overlap=False)}
        timed({name: (lambda b, m=mix: score(None, reference, b, 1.0, m))
               for name, mix in mixes.items()}, data)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
