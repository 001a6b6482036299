"""Time to quality, shared by the TRL benches (`trl_compare`, `trl_text`, `trl_gym`): from
each system's per-step wall times and batch scores, the steady throughput, the wall time until
a rolling mean of the score first reaches a target, and that against TRL's."""

from __future__ import annotations


def time_to_target(times: list[float], hidden: list[float], target: float,
                   window: int = 3) -> float | None:
    """Wall-clock (s) when the rolling mean of the last `window` batches first reaches
    `target`; None if it never does."""
    for i in range(len(hidden)):
        recent = hidden[max(0, i - window + 1): i + 1]
        if len(recent) == window and sum(recent) / window >= target:
            return times[i]
    return None


def summarise(step_s: list[float], samples: list[float], tokens: list[float],
              hidden: list[float], warmup: int, target: float) -> dict:
    """Steady throughput over steps after `warmup`, and time to the target score."""
    wall = sum(step_s[warmup:])
    cum = [sum(step_s[: i + 1]) for i in range(len(step_s))]
    return {"completions_per_s": sum(samples[warmup:]) / wall,
            "tokens_per_s": sum(tokens[warmup:]) / wall,
            "steps": len(step_s), "steady_wall_s": wall, "step_s": step_s, "samples": samples,
            "hidden": hidden, "first_hidden": hidden[0], "last_hidden": hidden[-1],
            "time_to_target_s": time_to_target(cum, hidden, target), "times": cum}


def time_to_quality(rows: dict[str, dict], target: float, window: int = 3) -> dict[str, dict]:
    """Per system, the wall time until the rolling mean over `window` batches of the hidden
    score (the batches' true score, of fresh prompts, before the policy trains on them; one
    batch of 64 is noisy, +-0.03) first reaches `target`: over the
    steps (`steps_s`), and with all of the RL phase's time outside its steps added
    (`wall_s`: node start and model loading for ours; for TRL building the trainer, which
    loads the policy and the reference, and `train()`'s own setup; shutdown too on both
    sides, so an upper bound). `vs_trl`: that wall time over TRL's soonest row (fp32 or bf16),
    < 1 = ours sooner (`vs_trl_steps`: the same over the steps alone); None where a side never
    reached the target."""
    out: dict[str, dict] = {}
    for name, r in rows.items():
        steps = time_to_target(r["times"], r["hidden"], target, window)
        overhead = max(r["rl_wall_s"] - sum(r["step_s"]), 0.0) + r.get("setup_s", 0.0)
        out[name] = {"steps_s": steps, "overhead_s": overhead,
                     "wall_s": None if steps is None else steps + overhead}
    for key, ratio in (("wall_s", "vs_trl"), ("steps_s", "vs_trl_steps")):
        trl = [q[key] for n, q in out.items() if n.startswith("trl") and q[key] is not None]
        best = min(trl) if trl else None
        for name, q in out.items():
            ours = not name.startswith("trl") and q[key] is not None
            q[ratio] = q[key] / best if ours and best else None
    return out


def print_time_to_quality(label: str, ttq: dict[str, dict], target: float, steps: int,
                          window: int) -> None:
    print(f"\n[{label}] time to a rolling hidden score of {target} ({window} batches), "
          f"{steps} steps")
    print(f"{'system':28s} {'steps s':>8s} {'+ outside steps s':>17s} {'wall s':>7s} "
          f"{'ours/TRL steps':>14s} {'ours/TRL wall':>13s}")
    for name, q in ttq.items():
        if q["wall_s"] is None:
            print(f"{name:28s} {'not reached':>8s} {q['overhead_s']:17.1f}")
            continue
        vs, vs_steps = (("-" if v is None else f"{v:.2f}x")
                        for v in (q["vs_trl"], q["vs_trl_steps"]))
        print(f"{name:28s} {q['steps_s']:8.1f} {q['overhead_s']:17.1f} {q['wall_s']:7.1f} "
              f"{vs_steps:>14s} {vs:>13s}")
