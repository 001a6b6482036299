"""Curves of a run's metrics.jsonl as one PNG (matplotlib Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf_async.metrics import read_metrics

PANELS = (("reward", "reward model score"), ("hidden_score", "hidden (true) score"),
          ("kl", "KL to reference (per sample)"), ("policy_loss", "policy loss"),
          ("value_loss", "value loss"), ("entropy", "entropy"),
          ("response_length", "response length"), ("samples_per_s", "samples / s"))


def plot_metrics(metrics_path: str | Path, out_path: str | Path, title: str = "") -> Path:
    records = read_metrics(metrics_path)
    panels = [(k, label) for k, label in PANELS if any(k in r for r in records)]
    cols = 4
    rows = max(1, (len(panels) + cols - 1) // cols)
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
