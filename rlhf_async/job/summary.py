"""What a finished run reports: the totals summary.json takes from its step records, and
the summary the CLI prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_async.metrics import read_metrics
from rlhf_async.strategies.step_health import episode_ends, trained_nothing
from rlhf_async.task.artefacts import Artefacts


def step_totals(metrics_path: Path, start_step: int) -> tuple[dict[str, Any], float]:
    """From every step's record: the run's episodes by how they ended (none for a
    single-turn task), its steps that trained on nothing and the samples it trained on;
    and the samples trained on since `start_step` (this invocation's throughput)."""
    records = read_metrics(metrics_path) if metrics_path.exists() else []
    ends = {how: sum(episode_ends(r)[how] for r in records) for how in
            ("failed", "truncated", "timeout")}
    trained = [float(r.get("trained_samples", r.get("samples", 0))) for r in records]
    return {"episodes": sum(sum(episode_ends(r).values()) for r in records),
            **{f"episodes_{how}": n for how, n in ends.items()},
            "failed_steps": sum(trained_nothing(r) for r in records),
            "trained_samples": sum(trained)}, \
        sum(n for n, r in zip(trained, records, strict=True) if r.get("step", 0) >= start_step)


def reward_model_used(given: str, art: Artefacts) -> str | None:
    """summary.json's `reward_model`: reward_model.path, the one the run trained (the
    built-in task's, in the cache), or None (a rule, an environment or an agent rewards)."""
    if given:
        return given
    return str(art.rm_dir) if art.rm_dir is not None else None


def format_summary(s: dict) -> str:
    """The run's summary as the CLI prints it (`s`: summary.json's content)."""
    head = (f"\nrun {s['run_dir']} ({s['algo']}, seed {s['seed']}, {s['strategy']} x"
            f"{s['devices']})\n")
    k = s.get("eval_samples", 1)
    n = f"{s['eval_prompts']} held-out prompts" + (f" x {k} samples" if k > 1 else "")
    if s.get("rm_accuracy") is None and s.get("reward_model"):  # the user's reward model
        if s.get("has_rule"):
            head += (f"  rule (task.reward) on {n}: initial "
                     f"{s['sft_hidden_score']:.3f} -> final {s['final_hidden_score']:.3f}\n")
        head += (f"  reward on {n}: initial {s['sft_reward']:.3f} -> final "
                 f"{s['final_reward']:.3f}\n")
    elif s.get("rm_accuracy") is None:  # a rule reward: no SFT, no reward model
        head += (f"  rule reward on {n}: initial "
                 f"{s['sft_reward']:.3f} -> final {s['final_reward']:.3f}\n")
    else:
        head += (
            f"  hidden score on {n}: "
            f"SFT {s['sft_hidden_score']:.3f} -> final {s['final_hidden_score']:.3f}\n"
            f"  reward-model score: SFT {s['sft_reward']:.3f} -> final {s['final_reward']:.3f}\n"
            f"  reward-model accuracy on held-out pairs: {s['rm_accuracy']:.3f} "
            f"(vs noisy labels {s['rm_label_accuracy']:.3f})\n")
    head += _worse_warning(s) + _episodes_line(s)
    return head + (
        f"  time: SFT+RM {s['pretrain_seconds']:.1f}s, RL {s['rl_seconds']:.1f}s "
        f"({s['rl_samples_per_s']:.3g} samples/s), total {s['wall_seconds']:.1f}s\n"
        f"  policy: {s['run_dir']}/policy   curves: {s['run_dir']}/metrics.png\n")


def _episodes_line(s: dict) -> str:
    """What the run trained on, and how its episodes failed (none for a single-turn task);
    a summary written before these counts existed has none to show."""
    if "episodes_failed" not in s:
        return ""
    line = (f"  trained on {s['trained_samples']:.0f} samples; episodes failed "
            f"{s['episodes_failed']}, truncated {s['episodes_truncated']}, timed out "
            f"{s['episodes_timeout']}" + (f" (of {s['episodes']})" if s["episodes"] else ""))
    if s.get("failed_steps"):
        line += f"; {s['failed_steps']} steps trained on nothing (every episode failed)"
    return line + "\n"



def _worse_warning(s: dict) -> str:
    """A plain line when RL made the policy worse on what it is judged by."""
    rule = s.get("rm_accuracy") is None
    before, after = (s["sft_reward"], s["final_reward"]) if rule else \
        (s["sft_hidden_score"], s["final_hidden_score"])
    if after >= before:
        return ""
    what = "rule reward" if rule else "hidden score"
    hacked = not rule and s["final_reward"] > s["sft_reward"]
    why = (" while the reward model's score rose: the policy over-optimised the reward model "
           "(reward hacking)") if hacked else ""
    return (f"  WARNING: the final policy is WORSE than the {'initial' if rule else 'SFT'} "
            f"policy on the {what} ({before:.3f} -> {after:.3f}){why}. Look at the kl and "
            f"reward panels of {s['run_dir']}/metrics.png; algo.kl_target (a target KL per "
            "sample) or fewer train.steps hold the policy nearer the reference.\n")
