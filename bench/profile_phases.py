"""Where one RL step's time goes, per phase and per operator (torch.profiler, CPU).

    python bench/profile_phases.py [--steps 3] [--warmup 1] [--top 8] [key=value ...]

Runs the lock-step loop's three phases (generate, score, train) on one process with the
library's own functions, as Flattening does on one device, each phase under
`record_function`. Prints, per phase: wall time, the time torch's operators account for
(the rest is Python and dispatch between them), and the operators that took the most
self time. Defaults are the generation-heavy setting of bench/README.md (10.7M-parameter
actor, 48-49 new tokens, 16 samples). Prints load averages before and after, and each
phase's CPU time beside its wall time: on a shared box the wall time follows the other
jobs' load, the CPU time of a one-thread process much less.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rlhf_async.config import load_config
from rlhf_async.log import configure_logging
from rlhf_async.modeling.compiled_decode import choose as choose_decode
from rlhf_async.modeling.generation import generate
from rlhf_async.planning.planner import prepare_run
from rlhf_async.rl.learner import Learner
from rlhf_async.strategies.flattening import full_scorer
from rlhf_async.task import make_task, sampling_params
from rlhf_async.task.artefacts import load_critic, load_sft, prepare_artefacts

GEN_HEAVY = ["model.hidden=384", "model.layers=6", "model.heads=6",
             "generation.max_new_tokens=49", "generation.min_new_tokens=48", "sft.steps=5",
             "reward_model.steps=5", "train.prompts_per_step=8", "algo.group_size=2",
             "train.epochs=1", "train.minibatches=1", "run.progress=false",
             "run.cache_dir=runs/cache"]
PHASES = ("generate", "score", "train")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps before profiling")
    ap.add_argument("--top", type=int, default=8, help="operators listed per phase")
    ap.add_argument("overrides", nargs="*", help="config overrides after the defaults")
    args = ap.parse_args(argv)
    configure_logging("warning")
    cfg, placement = prepare_run(load_config(None, [*GEN_HEAVY, *args.overrides]))
    torch.set_num_threads(cfg.placement.cpu_threads)
    device, precision = torch.device("cpu"), placement.precision()
    # as the lock-step loop decides it (`generation.compile=on`: the compiled decode step;
    # the warm-up steps then hold its compile)
    choose_decode(device, (args.steps + args.warmup) * cfg.generation.max_new_tokens,
                  cfg.generation.compile)
    task = make_task(cfg)
    art = prepare_artefacts(cfg, task)
    actor = load_sft(art.sft_dir)
    scorer = full_scorer(cfg, art, task, actor, 0, 1, device, precision)
    learner = Learner(actor, load_critic(cfg, art), cfg.algo, cfg.train, cfg.run.seed,
                      cfg.generation.temperature, precision, cfg.lora)
    params, seed, G = sampling_params(cfg, task), cfg.run.seed, cfg.algo.group_size
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    load_before = os.getloadavg()

    def step(s: int) -> None:
        prompts = task.prompt_batch(seed, "train", s, cfg.train.prompts_per_step, G)
        for phase in PHASES:
            t0, c0 = time.perf_counter(), time.process_time()
            with record_function(phase):
                if phase == "generate":
                    batch = generate(actor, prompts, params, seed, s, learner.version)
                elif phase == "score":
                    batch = scorer(batch)
                else:
                    learner.train_step(batch)
            if s >= args.warmup:
                wall[phase] += time.perf_counter() - t0
                cpu[phase] += time.process_time() - c0

    for s in range(args.warmup):
        step(s)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(args.warmup, args.warmup + args.steps):
            step(s)
    report(prof, wall, cpu, args, cfg.placement.cpu_threads, load_before, os.getloadavg())


def report(prof: profile, wall: dict[str, float], cpu: dict[str, float],
           args: argparse.Namespace, threads: int, before: tuple[float, ...],
           after: tuple[float, ...]) -> None:
    """Each phase's wall and CPU time, operator share and top operators (self CPU time)."""
    events = prof.events()
    ranges = sorted(((e.name, e.time_range.start, e.time_range.end) for e in events
                     if e.name in PHASES), key=lambda r: r[1])
    ops: dict[str, dict[str, float]] = {p: defaultdict(float) for p in PHASES}
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        phase = next((n for n, a, b in ranges if a <= e.time_range.start <= b), None)
        if phase is not None:
            ops[phase][e.name] += e.self_cpu_time_total / 1e6
            calls[phase] += 1
    total = sum(wall.values())
    print(f"{args.steps} steps after {args.warmup} warm-up, {threads} thread(s); load "
          f"average {before[0]:.2f} -> {after[0]:.2f}")
    print(f"{'phase':<9} {'wall s/step':>11} {'cpu s/step':>10} {'share':>6} {'op time':>8} "
          f"{'ops/step':>9}  top operators (self s/step)")
    for phase in PHASES:
        w = wall[phase] / args.steps
        op_s = sum(ops[phase].values()) / args.steps
        top = sorted(ops[phase].items(), key=lambda kv: -kv[1])[: args.top]
        names = ", ".join(f"{k[6:]} {v / args.steps:.3f}" for k, v in top)
        print(f"{phase:<9} {w:>11.3f} {cpu[phase] / args.steps:>10.3f} "
              f"{wall[phase] / total:>6.0%} {op_s / max(w, 1e-9):>8.0%} "
              f"{calls[phase] / args.steps:>9.0f}  {names}")


if __name__ == "__main__":
    main()
