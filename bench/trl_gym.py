"""Our GRPO against TRL's GRPOTrainer on a reasoning-gym dataset: SmolLM2-135M-Instruct (or
the config's model), the dataset's questions as chat prompts, its own `score_answer` as the
reward on both sides (default: examples/reasoning_gym/config.toml).

    .venv/bin/python -m bench.trl_gym [--config examples/reasoning_gym/config.toml]
        [--steps 30] [--target 0.15] [--out bench/results/trl_gym.json] [overrides ...]

Matched as in `bench.trl_text` (model, prompts per step, group size, max new tokens,
temperature, lr, clip, KL beta, group-std advantages, token-level loss, fp32, AdamW). One
run per side: ours as the config places it (`job.run`), TRL in one process at
`--trl-threads` torch threads. Reported per side: held-out accuracy (the dataset's score on
the held-out questions, `run.eval_prompts` of them, sampled at the config's temperature)
before -> after; the mean score of each training batch; the wall time; and the time until
the rolling mean of `--window` training batches first reaches `--target`. TRL's held-out
evaluations run outside its clock (before `train()`, and at its end with their time taken
off). Needs the `bench` extra, reasoning-gym and the model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.output import write_json
from bench.trl_compare import (
    plot_curves,
    print_table,
    run_ours,
    train_grpo,
)
from bench.ttq import print_time_to_quality, summarise, time_to_quality
from rlhf_async.config import ConfigError, JobConfig, load_config
from rlhf_async.log import configure_logging
from rlhf_async.runtime.launcher import ready_fork_server
from rlhf_async.strategies.registry import STRATEGIES
from rlhf_async.task import make_task
from rlhf_async.task.adapters import chosen
from rlhf_async.task.adapters.reasoning_gym import ReasoningGymAdapter
from rlhf_async.task.text import TextTask

OURS_ROW = "flattening"  # the example's placement; bench.trl_rows.OURS names its overrides


class GymReward:
    """The dataset's scorer (the task's rule) as a TRL reward function: each row carries its
    prompt's index in the task, so the scorer reads that question's entry; traces the mean
    score and the completion tokens per call."""

    __name__ = "score_answer"

    def __init__(self, task: TextTask) -> None:
        assert task.rule is not None  # a reasoning-gym source always has its scorer
        self.task, self.rule = task, task.rule
        self.hidden: list[float] = []
        self.tokens: list[float] = []

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]],
                 row: list[int], **_: object) -> list[float]:
        texts = [str(c[-1]["content"]) if isinstance(c, list) else str(c) for c in completions]
        out = self.rule([""] * len(texts), texts, [self.task.columns[i] for i in row], row)
        self.hidden.append(sum(out) / len(out))
        self.tokens.append(float(sum(len(ids) for ids in completion_ids)))
        return out


@torch.no_grad()
def heldout_accuracy(model: Any, tokenizer: Any, task: TextTask, cfg: JobConfig,
                     n: int) -> float:
    """Mean score on the first `n` held-out questions, sampled as ours samples them (the
    config's temperature and top-k, no top-p, `generation.max_new_tokens`)."""
    idx = task.eval_idx[:n]
    enc = tokenizer.apply_chat_template([task.prompts[i] for i in idx], return_dict=True,
                                        add_generation_prompt=True, padding=True,
                                        return_tensors="pt")
    torch.manual_seed(cfg.run.seed)
    g = cfg.generation
    out = model.generate(**enc, do_sample=True, temperature=g.temperature, top_k=g.top_k or 0,
                         top_p=1.0, max_new_tokens=g.max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert task.rule is not None
    scores = task.rule([""] * len(idx), texts, [task.columns[i] for i in idx], idx)
    return sum(scores) / len(scores)


def run_trl(cfg: JobConfig, args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    task = make_task(cfg)
    assert isinstance(task, TextTask)
    tok = AutoTokenizer.from_pretrained(cfg.model.path, padding_side="left")
    n_eval = min(cfg.run.eval_prompts, len(task.eval_idx))
    torch.set_num_threads(args.trl_threads)
    before = heldout_accuracy(AutoModelForCausalLM.from_pretrained(cfg.model.path).eval(),
                              tok, task, cfg, n_eval)
    after: dict[str, float] = {}

    class FinalEval(TrainerCallback):
        def on_train_end(self, *a: object, model: Any = None, **k: object) -> None:
            t0 = time.perf_counter()
            after["accuracy"] = heldout_accuracy(model.eval(), tok, task, cfg, n_eval)
            after["seconds"] = time.perf_counter() - t0

    rows = [{"prompt": task.prompts[i], "row": i} for i in task.train_idx]
    t, algo = cfg.train, cfg.algo
    data = Dataset.from_list(rows * (1 + t.prompts_per_step * args.steps // len(rows)))
    reward = GymReward(task)
    step_s, total, setup = train_grpo(
        cfg.model.path, cfg.model.path, data, reward, args.trl_threads,
        callbacks=(FinalEval(),),
        per_device_train_batch_size=t.prompts_per_step * algo.group_size,
        num_generations=algo.group_size, max_completion_length=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature, top_k=cfg.generation.top_k or 0,
        learning_rate=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
        beta=algo.kl_coef, epsilon=algo.clip_eps, max_steps=args.steps, seed=cfg.run.seed,
        bf16=False)
    n = min(len(step_s), len(reward.hidden))
    out = summarise(step_s[:n], [t.prompts_per_step * algo.group_size] * n, reward.tokens[:n],
                    reward.hidden[:n], args.warmup, args.target)
    out.update(rl_wall_s=total - after["seconds"], setup_s=setup,
               heldout_before=before, heldout_after=after["accuracy"], heldout_prompts=n_eval)
    return out


def ours(base: list[str], args: argparse.Namespace, output_dir: Path) -> dict:
    """Our run as `job.run` makes it; held-out before/after from its summary.json."""
    out = run_ours(OURS_ROW, base, args.warmup, args.target, args.config)
    summary = max(output_dir.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    s = json.loads(summary.read_text())
    out.update(heldout_before=s["sft_reward"], heldout_after=s["final_reward"],
               heldout_prompts=s["eval_prompts"], run_dir=s["run_dir"])
    return out


def print_heldout(rows: dict[str, dict]) -> None:
    print("\nheld-out accuracy (the dataset's score) before -> after, RL wall time")
    for name, r in rows.items():
        print(f"{name:28s} {r['heldout_before']:.3f} -> {r['heldout_after']:.3f} on "
              f"{r['heldout_prompts']} prompts, {r['rl_wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/reasoning_gym/config.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.15,
                    help="mean score of the training batches to reach")
    ap.add_argument("--window", type=int, default=3,
                    help="time to quality: batches in the rolling mean of the score")
    ap.add_argument("--trl-threads", type=int, default=1)
    ap.add_argument("--only", choices=("trl", "ours"), default=None)
    ap.add_argument("--out", default="bench/results/trl_gym.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for both sides")
    args = ap.parse_args(argv)
    configure_logging("warning")
    output_dir = Path("runs/bench-trl-gym").resolve()
    # TRL's beta is fixed (no adaptive KL on our side) and it evaluates only before and
    # after: so do we (run.eval_every = 0), and neither side's steps carry an evaluation
    base = [f"train.steps={args.steps}", "algo.kl_target=0", "run.plot=false",
            "run.eval_every=0", "run.progress=false", f"run.output_dir={output_dir}",
            "run.checkpoint_every=0", *args.overrides]
    try:
        cfg = load_config(args.config, base)
        if cfg.task.name != "text" or not any(isinstance(a, ReasoningGymAdapter) for a in chosen(cfg.task)) or cfg.task.reward:
            raise ConfigError([f"{args.config}: this benchmark needs task.name = 'text' with "
                               "task.prompts = 'reasoning_gym:<dataset>' and no task.reward "
                               "(the dataset's scorer is the reward on both sides)"])
        make_task(cfg)  # the dataset, its scorer and the tokenizer load
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ready_fork_server(STRATEGIES[cfg.placement.strategy].fork_preload)
    rows: dict[str, dict] = {}
    load = {"start": os.getloadavg()}
    if args.only in (None, "trl"):
        print(f"trl {args.trl_threads}t ...", file=sys.stderr)
        rows[f"trl {args.trl_threads}t"] = run_trl(cfg, args)
    if args.only in (None, "ours"):
        print("ours ...", file=sys.stderr)
        rows[f"ours {OURS_ROW}"] = ours(base, args, output_dir)
    load["end"] = os.getloadavg()
    label = f"{Path(cfg.model.path).name} on {cfg.task.prompts}"
    print_table(label, rows, args.target)
    ttq = time_to_quality(rows, args.target, args.window)
    print_time_to_quality(label, ttq, args.target, args.steps, args.window)
    print_heldout(rows)
    print(f"load average: start {load['start']}, end {load['end']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"args": vars(args), "loadavg": load, "results": rows,
                     "time_to_quality": ttq}, indent=1)
    plot_curves(rows, out.with_suffix(".png"), f"GRPO: TRL vs ours, {label}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
