"""Our GRPO against TRL's GRPOTrainer: same model, reward, batch and settings, one machine.

    .venv/bin/python -m bench.trl_compare [--quick] [--size 4x128 6x384] [--steps 30]
                                          [--new-tokens 48]

Both sides start from the same SFT policy (a tiny GPT-2 made in code, trained and cached by
the built-in job) and are rewarded by the same Bradley-Terry reward model; both use GRPO
with the same prompts per step, responses per prompt, max new tokens, learning rate,
temperature 1 / no top-k, clip 0.2, KL beta (k3 in the loss), group-std advantage scaling,
token-level loss normalisation, one optimizer step per batch, grad clip 1.0, AdamW
defaults and fp32 (TRL's default bf16 autocast is turned off; `--trl-bf16` adds a row with
it, `--bf16` that row and ours in bf16: every model in bf16, generation in fp32
("gen-fp32"), and Separation's scorer beside the trainer ("scorer@trainer")). TRL gets
every core as torch threads in one process (its normal CPU use); ours runs as a user runs
it (`job.run`) with each strategy on every core. Reported: completions/s and completion tokens/s over the steady steps (warm-up
excluded), the whole RL phase's wall time (process start and model loading included for
ours; TRL's `train()`), and the wall-clock until the hidden score (the task's true score;
rolling mean of 3 training batches) first reaches the target.

MFU: both sides' model FLOPs per step (modeling/flops.py, from the same token counts:
generation, reward and reference forwards, training's passes) over the steady wall time
and the fp32 matmul peak of `--cores` one-thread slots: the best of its measurements at
start and after each size (`machine_peaks` in the JSON).

`--new-tokens N`, generation-heavy: both sides generate N tokens (EOS only as the N-th; the
task's answer is 7), the reward model scores all N and the hidden score is no learning
signal (throughput only). Needs the `bench` extra. Writes bench/results/trl_compare.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.output import write_json
from bench.plots import plot_runs
from bench.trl_mfu import machine_peak, rescale_mfu, step_mfu
from bench.trl_rows import OURS, OURS_BF16, OURS_COMPILED, SIZES, our_rows, trl_rows
from bench.ttq import print_time_to_quality, summarise, time_to_quality
from rlhf_async import job
from rlhf_async.config import JobConfig, load_config
from rlhf_async.log import configure_logging
from rlhf_async.metrics import read_metrics
from rlhf_async.modeling.flops import token_counts
from rlhf_async.modeling.models import sequence_scores
from rlhf_async.runtime.cpu import flushes_denormal
from rlhf_async.runtime.launcher import ready_fork_server
from rlhf_async.strategies.registry import STRATEGIES
from rlhf_async.task import SortDigitsTask
from rlhf_async.task.artefacts import load_reward_model, prepare_artefacts

TOKENS = ["<pad>", "<bos>", "<sep>", "<eos>", *map(str, range(10)), "<unused14>", "<unk>"]


def shared_overrides(args: argparse.Namespace, size: str) -> list[str]:
    layers, hidden, heads = SIZES[size]
    return [f"model.layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            "algo.name=grpo", f"algo.group_size={args.group}", f"algo.kl_coef={args.beta}",
            # TRL's beta is fixed: no adaptive KL controller on our side either
            "algo.kl_target=0", "algo.kl_mode=loss", "algo.kl_estimator=k3", "train.epochs=1",
            "train.minibatches=1", f"train.lr={args.lr}", f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", "run.plot=false",
            "run.eval_prompts=64", "run.output_dir=runs/bench-trl", "run.checkpoint_every=0",
            f"placement.devices={args.cores}", *new_tokens(args), *args.overrides]


def new_tokens(args: argparse.Namespace) -> list[str]:
    """Our overrides for --new-tokens: that many tokens per completion (EOS only last)."""
    n = args.new_tokens
    return [f"generation.max_new_tokens={n}", f"generation.min_new_tokens={n - 1}"] if n else []


def run_ours(name: str, base: list[str], warmup: int, target: float,
             config_path: str | None = None, peak: float = 0.0) -> dict:
    over = {**OURS, **OURS_COMPILED, **OURS_BF16}[name]
    cfg = load_config(config_path, base + over + [f"run.name=ours-{time.time_ns()}"])
    s = job.run(cfg)
    recs = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")
    # the weights are not a result here: SmolLM2's 0.5 GB a run filled the disk after ~35
    # runs; the metrics, config and logs stay
    for weights in ("policy", "checkpoints"):
        shutil.rmtree(Path(s["run_dir"]) / weights, ignore_errors=True)
    step_s = [r.get("time_step") or r["time_generate"] + r["time_score"] + r["time_train"]
              for r in recs]
    out = summarise(step_s, [r["samples"] for r in recs],
                    [r["samples"] * r["response_length"] for r in recs],
                    [r["hidden_score"] for r in recs], warmup, target)
    out["rl_wall_s"] = s["rl_seconds"]
    if peak > 0:  # (trl_text and trl_gym measure none: their tasks are not sort-digits)
        out["mfu_step"] = step_mfu(prepare_artefacts(cfg, SortDigitsTask(cfg.task)),
                                   recs[warmup:], None, out["steady_wall_s"], peak)
    # the held-out evaluation of the policy before and after (run.eval_prompts x eval_samples)
    out["eval"] = {"initial": s["sft_hidden_score"], "final": s["final_hidden_score"],
                   "prompts": s["eval_prompts"], "samples": s.get("eval_samples", 1)}
    return out


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer for the task's 16-token vocabulary (ids match the task's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")
    fast.save_pretrained(path)


class RewardFn:
    """The reward model as a TRL reward function; also traces the hidden score per call."""

    __name__ = "reward_model"

    def __init__(self, rm: torch.nn.Module, task: SortDigitsTask, width: int) -> None:
        self.rm, self.task, self.width = rm, task, width
        self.hidden: list[float] = []
        self.tokens: list[float] = []
        self.counts: list[dict[str, float]] = []  # each batch's token counts (its FLOPs)

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]],
                 digits: list[list[int]], **_: object) -> list[float]:
        p_ids, p_mask = self.task.encode_prompts(digits)
        r_ids, r_mask = self.task.encode_responses(completion_ids, self.width)
        self.hidden.append(float(self.task.hidden_scores(p_ids, r_ids, r_mask).mean()))
        self.tokens.append(float(r_mask.sum()))
        self.counts.append({k: float(v.sum()) for k, v in token_counts(p_mask, r_mask).items()}
                           | {"samples": float(len(r_mask))})
        return sequence_scores(self.rm, p_ids, p_mask, r_ids, r_mask).tolist()


def train_grpo(model_path: str, tokenizer_path: str, data: Any, reward: Any, threads: int,
               callbacks: tuple = (), **settings: Any) -> tuple[list[float], float, float]:
    """TRL's GRPOTrainer on `data` with the settings both comparisons share plus `settings`
    (batch, generations, lengths, lr, beta, ...) and trainer `callbacks`. -> per-step
    seconds, train() seconds, seconds to build the trainer before it (the two models)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: object, **k: object) -> None:
            stamps.append(time.perf_counter())

        def on_step_end(self, *a: object, **k: object) -> None:
            stamps.append(time.perf_counter())

    torch.set_num_threads(threads)  # after run_trl's flush setting: a new thread inherits it
    t_setup = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        gcfg = GRPOConfig(
            output_dir=tmp, use_cpu=settings.pop("use_cpu", True), gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, top_p=1.0, lr_scheduler_type="constant",
            warmup_steps=0, loss_type="dapo", scale_rewards="group", logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False, **settings)
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path), args=gcfg,
            reward_funcs=reward, train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left"),
            callbacks=[*callbacks, Clock()])
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
    return [b - a for a, b in itertools.pairwise(stamps)], total, t0 - t_setup


@contextlib.contextmanager
def flushed(on: bool) -> Iterator[None]:
    """This thread (and each thread it starts) flushing subnormal floats to zero while
    inside, or not: as `on` says, whatever our in-process job left; as before, after. A thread
    pool already running keeps the setting of its start (main sets it before any starts)."""
    before = flushes_denormal()
    torch.set_flush_denormal(on)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def run_trl(cfg: JobConfig, args: argparse.Namespace, threads: int, target: float,
            bf16: bool = False, flush_denormal: bool = False) -> dict:
    from datasets import Dataset

    task = SortDigitsTask(cfg.task)
    art = prepare_artefacts(cfg, task)
    digits = task.prompts(cfg.run.seed, "train", 0, args.prompts * args.steps)
    data = Dataset.from_list([{"prompt": "<bos> " + " ".join(map(str, d)) + " <sep>",
                               "digits": d} for d in digits])
    width = args.new_tokens or task.response_len
    reward = RewardFn(load_reward_model(art.rm_dir), task, width)
    fixed = {"generation_kwargs": {"min_new_tokens": width - 1}} if args.new_tokens else {}
    with tempfile.TemporaryDirectory() as tok, flushed(flush_denormal):
        save_tokenizer(Path(tok))
        step_s, total, setup = train_grpo(
            str(art.sft_dir), tok, data, reward, threads,
            per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
            max_completion_length=width, temperature=1.0, top_k=0, **fixed,
            learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta,
            epsilon=0.2, max_steps=args.steps, seed=cfg.run.seed,
            bf16=bf16,  # TRL defaults to bf16 autocast; ours computes in fp32
            use_cpu=cfg.placement.device != "cuda")  # on the GPU ours runs on (gpu_check)
    n = min(len(step_s), len(reward.hidden))
    out = summarise(step_s[:n], [args.prompts * args.group] * n, reward.tokens[:n],
                    reward.hidden[:n], args.warmup, target)
    out["rl_wall_s"], out["setup_s"] = total, setup
    # TRL's GRPO step: generation, reward and reference forwards, one forward + backward
    # (no separate old-log-prob forward with one iteration per generation)
    out["mfu_step"] = step_mfu(art, reward.counts[args.warmup:n], 3.0, out["steady_wall_s"],
                               args.machine_peak)
    return out


def print_table(size: str, rows: dict[str, dict], target: float) -> None:
    """One row per system; "vs TRL" is against TRL's fastest row, fp32 or bf16."""
    trl = max((r["completions_per_s"] for n, r in rows.items() if n.startswith("trl")),
              default=None)
    print(f"\n[{size}] target hidden score {target}")
    print(f"{'system':28s} {'compl/s':>8s} {'tok/s':>8s} {'vs TRL':>7s} {'RL wall s':>9s} "
          f"{'to target s':>11s} {'hidden first->last':>19s} {'MFU':>6s}")
    for name, r in rows.items():
        vs = f"{r['completions_per_s'] / trl:.2f}x" if trl else "-"
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        mfu = f"{r['mfu_step']:.1%}" if "mfu_step" in r else "-"
        print(f"{name:28s} {r['completions_per_s']:8.1f} {r['tokens_per_s']:8.0f} {vs:>7s} "
              f"{r['rl_wall_s']:9.1f} {tt:>11s} {r['first_hidden']:8.3f} -> "
              f"{r['last_hidden']:.3f} {mfu:>6s}")


def report(path: Path, target: float, window: int) -> int:
    """The time-to-quality tables of a results file, at another target or window."""
    saved = json.loads(path.read_text())
    for label, rows in saved["results"].items():
        print_time_to_quality(label, time_to_quality(rows, target, window), target,
                              saved["args"]["steps"], window)
    start, end = saved.get("loadavg_start") or ["?"], saved["loadavg"]
    print(f"\n(measured at 1-min load average {start[0]:.3} -> {end[0]:.3})")
    return 0


def plot_curves(rows: dict[str, dict], path: Path, title: str) -> Path:
    """Completions/s (over the last 3 steps: a pipelined step can end moments after the
    previous one) and hidden score against wall-clock, one line per system."""
    runs = {}
    for name, r in rows.items():
        n, s = r["samples"], r["step_s"]
        rate = [sum(n[max(0, i - 2):i + 1]) / max(sum(s[max(0, i - 2):i + 1]), 1e-9)
                for i in range(len(n))]
        runs[name] = {"series": {"t": r["times"], "hidden_score": r["hidden"],
                                 "samples_per_s": rate}}
    return plot_runs(runs, path, title)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the built-in 2x64 model only, 12 steps")
    ap.add_argument("--size", nargs="+", default=["4x128", "6x384"], choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta", type=float, default=0.05, help="KL coefficient (both sides)")
    ap.add_argument("--target", type=float, default=0.55, help="hidden score to reach")
    ap.add_argument("--window", type=int, default=3,
                    help="time to quality: batches in the rolling mean of the hidden score")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="run nothing: the time-to-quality report of a results file written "
                    "by this script, at --target and --window")
    ap.add_argument("--new-tokens", type=int, default=0,
                    help="generation-heavy rows: this many new tokens per completion on both "
                    "sides, EOS only as the last (0: the task's own length, EOS ends one)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--trl-threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                    help="torch thread counts to run TRL with (each is one row; the best "
                    "fp32 row is the TRL number)")
    ap.add_argument("--trl-bf16", action="store_true",
                    help="also run TRL with its default bf16 autocast (not matched: ours "
                    "computes in fp32)")
    ap.add_argument("--compiled", action="store_true",
                    help="also our Separation k=1 with the compiled decode step "
                    "(generation.compile=on, what auto picks for long jobs)")
    ap.add_argument("--trl-flush-denormal", action="store_true",
                    help="TRL's rows with subnormal floats flushed to zero, as ours runs by "
                    "default (placement.flush_denormal); set before any thread starts")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 rows on both sides: TRL's default autocast and ours with "
                    "every model in bf16 (placement.dtype)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of: trl, " + ", ".join(OURS))
    ap.add_argument("--out", default="bench/results/trl_compare.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for our side and the SFT/RM")
    args = ap.parse_args(argv)
    if args.report:
        return report(Path(args.report), args.target, args.window)
    torch.set_flush_denormal(args.trl_flush_denormal)  # before a thread pool starts (flushed())
    try:
        import trl
    except ImportError:
        print("trl_compare: needs the bench extra: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.quick:
        args.size, args.steps = ["2x64"], min(args.steps, 12)
    configure_logging("warning")
    # our nodes' imports (the fork server's) paid before any clock, as TRL's in this process
    ready_fork_server(STRATEGIES["separation"].fork_preload)
    load_start = os.getloadavg()
    args.machine_peaks = [machine_peak(args.cores)]  # at start, then after each size
    args.machine_peak = args.machine_peaks[0]
    results: dict = {}
    ttq: dict[str, dict] = {}
    for size in args.size:
        base = shared_overrides(args, size)
        cfg = load_config(None, base)
        trl = {name: spec for name, *spec in trl_rows(args)}
        names = [n for n in (*trl, *our_rows(args)) if not args.only or n.split()[0] in args.only
                 or n in args.only]
        rows: dict[str, dict] = {}
        for name in names:  # trl first: it trains (or reuses) the shared SFT and RM
            print(f"[{size}] {name} ...", file=sys.stderr, flush=True)
            if name in trl:
                threads, bf16, ftz = trl[name]
                rows[name] = run_trl(cfg, args, threads, args.target, bf16, ftz)
            else:
                rows[name] = run_ours(name, base, args.warmup, args.target,
                                      peak=args.machine_peak)
        label = f"{size} {args.new_tokens} tokens" if args.new_tokens else size
        measured = args.machine_peak  # the MFU denominator: the best peak measured so far
        args.machine_peaks.append(machine_peak(args.cores))
        args.machine_peak = max(args.machine_peaks)
        rescale_mfu(rows, measured, args.machine_peak)
        print_table(label, rows, args.target)
        ttq[label] = time_to_quality(rows, args.target, args.window)
        print_time_to_quality(label, ttq[label], args.target, args.steps, args.window)
        out = Path(args.out)  # trl_compare.json -> trl_compare_<size>.png
        plot_curves(rows, out.with_name(f"{out.stem}_{label.replace(' ', '_')}.png"),
                    f"GRPO: TRL vs ours, {label} GPT-2, target {args.target}")
        results[label] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    write_json(out, {"args": vars(args), "loadavg_start": load_start,
                     "loadavg": load, "results": results,
                     "time_to_quality": ttq}, indent=2)
    print(f"\nload average {load_start[0]:.1f} at start, {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at end; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
