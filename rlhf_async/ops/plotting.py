"""Curves of a run's metrics.jsonl as one PNG (matplotlib Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from rlhf_async.metrics import read_metrics

PANELS = (("reward", "reward model score"), ("hidden_score", "hidden (true) score"),
          ("kl", "KL to reference (per sample)"), ("policy_loss", "policy loss"),
          ("value_loss", "value loss"), ("entropy", "entropy"),
          ("response_length", "response length"), ("samples_per_s", "samples / s"))


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, imported on first use: importing it takes
    ~0.4 s, which every process that imports the job (and every node or rank it starts,
    re-importing the launching script) would otherwise pay without drawing anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels_for(records: list[dict], rule_reward: bool = False) -> list[tuple[str, str]]:
    """(metric, title) of every panel with data. With `rule_reward` (the user's rule is the
    reward, so "reward" and "hidden_score" are the same number) one "rule reward" panel."""
    panels = [(k, label) for k, label in PANELS if any(k in r for r in records)]
    if rule_reward:
        panels = [("reward", "rule reward") if k == "reward" else (k, label)
                  for k, label in panels if k != "hidden_score"]
    return panels


def plot_metrics(metrics_path: str | Path, out_path: str | Path, title: str = "",
                 rule_reward: bool = False) -> Path:
    records = read_metrics(metrics_path)
    panels = panels_for(records, rule_reward)
    cols = 4
    rows = max(1, (len(panels) + cols - 1) // cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
