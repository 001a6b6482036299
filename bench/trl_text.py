"""Our GRPO against TRL's GRPOTrainer on a text task: a local HF model, a prompts file and a
rule reward, all taken from one config (default: deploy/configs/smollm2.toml, i.e.
SmolLM2-135M-Instruct from `rlhf-async prepare-smollm2`).

    .venv/bin/python -m bench.trl_text [--config deploy/configs/smollm2.toml] [--steps 6]

Matched from the config: model, chat template, prompts per step, responses per prompt, max
new tokens, temperature (no top-k / top-p), learning rate, clip, KL beta (k3 in the loss),
group-std advantage scaling, token-level loss normalisation (`dapo`), one optimizer step
per batch, grad clip, AdamW defaults, fp32 (TRL's default bf16 autocast off; `--trl-bf16`
adds a row with it, `--bf16` that row and ours in bf16). TRL draws its own prompt order
from the same training prompts (held-out ones excluded); the rule reward sees the same
(prompt, response) text on both sides. Reported as in `bench.trl_compare`, with the mean
rule reward per batch in the "hidden" columns, and our runs' initial and final policies
scored on the held-out prompts (`--eval-samples` responses each). Needs the `bench` extra
and the model directory.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from bench.output import write_json
from bench.trl_compare import plot_curves, print_table, run_ours, train_grpo
from bench.trl_rows import OURS, our_rows, trl_rows
from bench.ttq import print_time_to_quality, summarise, time_to_quality
from rlhf_async.config import ConfigError, JobConfig, load_config
from rlhf_async.log import configure_logging
from rlhf_async.runtime.launcher import ready_fork_server
from rlhf_async.strategies.registry import STRATEGIES
from rlhf_async.task import make_task
from rlhf_async.task.text import TextTask


class RuleReward:
    """The config's rule as a TRL reward function; traces the mean reward per call."""

    __name__ = "rule"

    def __init__(self, task: TextTask) -> None:
        assert task.rule is not None  # main refuses a text task without one
        self.rule = task.rule
        self.hidden: list[float] = []
        self.tokens: list[float] = []

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]],
                 **_: object) -> list[float]:
        def text(x: object) -> str:  # conversational: a list of {"role", "content"} turns
            return str(x[-1]["content"]) if isinstance(x, list) else str(x)

        n = len(prompts)
        out = self.rule([text(p) for p in prompts], [text(c) for c in completions],
                        [{}] * n, [-1] * n)
        self.hidden.append(sum(out) / len(out))
        self.tokens.append(float(sum(len(ids) for ids in completion_ids)))
        return out


def run_trl(cfg: JobConfig, args: argparse.Namespace, threads: int, bf16: bool) -> dict:
    from datasets import Dataset

    task = make_task(cfg)
    assert isinstance(task, TextTask)  # checked by main
    prompts = [task.prompts[i] for i in task.train_idx]
    rows = [{"prompt": [{"role": "user", "content": p}] if cfg.task.chat_template else p}
            for p in prompts]
    data = Dataset.from_list(rows * (1 + cfg.train.prompts_per_step * args.steps // len(rows)))
    reward = RuleReward(task)
    g, t, algo = cfg.generation, cfg.train, cfg.algo
    step_s, total, _ = train_grpo(
        cfg.model.path, cfg.model.path, data, reward, threads,
        per_device_train_batch_size=t.prompts_per_step * algo.group_size,
        num_generations=algo.group_size, max_completion_length=g.max_new_tokens,
        temperature=g.temperature, top_k=g.top_k or 0, learning_rate=t.lr,
        weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, beta=algo.kl_coef,
        epsilon=algo.clip_eps, max_steps=args.steps, seed=cfg.run.seed,
        bf16=bf16)  # TRL defaults to bf16 autocast; ours computes in fp32
    n = min(len(step_s), len(reward.hidden))
    out = summarise(step_s[:n], [t.prompts_per_step * algo.group_size] * n, reward.tokens[:n],
                    reward.hidden[:n], args.warmup, args.target)
    out["rl_wall_s"] = total
    return out


def same_samples(rows: dict[str, dict], window: int, base: str = "flattening") -> dict[str, dict]:
    """Per system, the mean reward of the last `window` batches up to the largest number of
    samples every system generated (`samples`), and that over `base`'s (`vs_base`: 1 = as
    good; None without a positive `base` reward). Asynchrony is lossless when it learns as
    much per sample as the synchronous run, so this compares at equal samples, not equal
    time."""
    cum = {name: [sum(r["samples"][: i + 1]) for i in range(len(r["samples"]))]
           for name, r in rows.items()}
    n = min((c[-1] for c in cum.values() if c), default=0)
    out: dict[str, dict] = {}
    for name, r in rows.items():
        last = max((i for i, c in enumerate(cum[name]) if c <= n), default=None)
        recent = [] if last is None else r["hidden"][max(0, last - window + 1): last + 1]
        out[name] = {"samples": n, "reward": sum(recent) / len(recent) if recent else None}
    ref = out.get(base, {}).get("reward")
    for q in out.values():
        q["vs_base"] = q["reward"] / ref if q["reward"] is not None and ref and ref > 0 else None
    return out


def split_only(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--only` is greedy: config overrides written after it (`--only trl run.seed=1`) land in
    it; move them to the overrides, and refuse a name that is no row."""
    if args.only is None:
        return
    def override(o: str) -> bool:  # a dotted key, then "=": row names have a space before
        return re.match(r"[\w.-]+=", o) is not None

    args.overrides = [o for o in args.only if override(o)] + args.overrides
    args.only = [o for o in args.only if not override(o)]
    names = ["trl", *OURS]
    unknown = [o for o in args.only if o not in names]
    if unknown:
        ap.error(f"--only: unknown row(s) {', '.join(map(repr, unknown))}; accepted: "
                 + ", ".join(map(repr, names)))


def final_policies(rows: dict[str, dict], base: str = "flattening") -> dict[str, dict]:
    """Per run of ours, the held-out score of its final policy (every run trained on the same
    samples: train.steps batches) and that over `base`'s: the policies compared after equal
    samples, each scored by `run.eval_samples` responses per held-out prompt, where the
    batch rewards of `same_samples` score the policy that generated them (one version older
    under Separation k=1) on 48 responses."""
    out = {name: dict(r["eval"]) for name, r in rows.items() if "eval" in r}
    ref = out.get(base, {}).get("final")
    for q in out.values():
        q["vs_base"] = q["final"] / ref if ref else None
    return out


def print_final_policies(label: str, finals: dict[str, dict]) -> None:
    if not finals:
        return
    q0 = next(iter(finals.values()))
    print(f"\n[{label}] held-out rule reward, {q0['prompts']} prompts x {q0['samples']} "
          "samples: initial -> final policy")
    for name, q in finals.items():
        vs = "-" if q["vs_base"] is None else f"{q['vs_base']:.2f}x flattening"
        print(f"{name:28s} {q['initial']:.3f} -> {q['final']:.3f} {vs:>18s}")


def print_same_samples(label: str, same: dict[str, dict], window: int) -> None:
    n = next(iter(same.values()))["samples"] if same else 0
    print(f"\n[{label}] mean reward of the last {window} batches at {n} samples")
    for name, q in same.items():
        vs = "-" if q["vs_base"] is None else f"{q['vs_base']:.2f}x flattening"
        reward = "-" if q["reward"] is None else f"{q['reward']:.3f}"
        print(f"{name:28s} {reward:>8s} {vs:>18s}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="deploy/configs/smollm2.toml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--target", type=float, default=1.0, help="mean rule reward to reach")
    ap.add_argument("--window", type=int, default=3,
                    help="time to quality: batches in the rolling mean of the reward")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--trl-threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--trl-bf16", action="store_true",
                    help="also run TRL with its default bf16 autocast (ours is fp32)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 rows on both sides: TRL's default autocast and ours with "
                    "every model in bf16 (placement.dtype)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of: trl, " + ", ".join(OURS))
    ap.add_argument("--eval-samples", type=int, default=8,
                    help="our runs: sampled responses per held-out prompt in the evaluation "
                    "of the initial and final policies (run.eval_samples)")
    ap.add_argument("--out", default="bench/results/trl_text.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for both sides")
    args = ap.parse_args(argv)
    split_only(ap, args)
    configure_logging("warning")
    # TRL's beta is fixed: no adaptive KL controller on our side either (algo.kl_target)
    base = [f"train.steps={args.steps}", "algo.kl_target=0", "run.plot=false",
            f"run.eval_samples={args.eval_samples}",
            "run.output_dir=runs/bench-trl-text", "run.checkpoint_every=0",
            f"placement.devices={args.cores}", *args.overrides]
    try:
        cfg = load_config(args.config, base)
        if cfg.task.name != "text":
            raise ConfigError([(f"{args.config}: task.name is {cfg.task.name!r}; this "
                                "benchmark needs a text task (bench.trl_compare runs the "
                                "built-in one)")])
        if not cfg.task.reward:
            raise ConfigError([f"{args.config}: task.reward is empty; this benchmark "
                               "compares on the rule reward"])
        make_task(cfg)  # the prompts file, the reward function and the tokenizer load
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # our nodes' imports paid before any clock, as TRL's are
    ready_fork_server(STRATEGIES["separation"].fork_preload)
    load_start = os.getloadavg()
    rows: dict[str, dict] = {}
    for name, threads, bf16, _ in trl_rows(args) if not args.only or "trl" in args.only else []:
        print(f"{name} ...", file=sys.stderr)
        rows[name] = run_trl(cfg, args, threads, bf16)
    for name in [n for n in our_rows(args) if not args.only or n in args.only]:
        print(f"{name} ...", file=sys.stderr)
        rows[name] = run_ours(name, base, args.warmup, args.target, args.config)
    label = Path(cfg.model.path).name
    print_table(label, rows, args.target)
    ttq = time_to_quality(rows, args.target, args.window)
    print_time_to_quality(label, ttq, args.target, args.steps, args.window)
    same = same_samples(rows, args.window)
    print_same_samples(label, same, args.window)
    finals = final_policies(rows)
    print_final_policies(label, finals)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"args": vars(args), "loadavg_start": load_start,
                     "loadavg": os.getloadavg(), "results": rows,
                     "time_to_quality": ttq, "same_samples": same,
                     "final_policies": finals}, indent=1)
    plot_curves(rows, out.with_suffix(".png"), f"GRPO: TRL vs ours, {Path(cfg.model.path).name}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
