"""PNG plots of benchmark results: one figure with a panel per measured quantity, every
strategy (or system) as one line, x = wall-clock seconds of the RL phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_async.ops.plotting import pyplot

# (series key in a result's "series", panel title)
PANELS = (("samples_per_s", "samples / s"), ("tokens_per_s", "completion tokens / s"),
          ("hidden_score", "hidden score (training batches)"),
          ("queue_depth", "queued chunks (all queues)"), ("staleness", "mean staleness"),
          ("weight_sync_s", "weight-sync time (s)"))


def plot_runs(results: dict[str, dict], out_path: str | Path, title: str = "") -> Path:
    """`results[name]["series"]` holds "t" (s) and any PANELS key (lists of equal length);
    `results[name]["utilisation"]` ({stage: busy fraction}) becomes a bar panel."""
    panels = [(k, label) for k, label in PANELS
              if any(k in r.get("series", {}) for r in results.values())]
    cols = 4
    rows = max(1, (len(panels) + 1 + cols - 1) // cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    flat = list(axes.flat)
    color = {name: f"C{i}" for i, name in enumerate(results)}  # one colour per run everywhere
    for ax, (key, label) in zip(flat, panels, strict=False):
        for name, r in results.items():
            s = r.get("series", {})
            if key in s:
                ax.plot(s["t"], s[key], label=name, marker=".", linewidth=1, color=color[name])
        ax.set_title(label)
        ax.set_xlabel("wall-clock (s)")
        ax.grid(alpha=0.3)
    flat[0].legend(fontsize=7)
    used = len(panels)
    if any(r.get("utilisation") for r in results.values()):
        _utilisation(flat[used], results)
        used += 1
    for ax in flat[used:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _utilisation(ax: Any, results: dict[str, dict]) -> None:
    """Grouped bars: per-stage busy fraction of each strategy (steady steps)."""
    stages = sorted({s for r in results.values() for s in r.get("utilisation", {})})
    width = 0.8 / max(1, len(results))
    for i, (name, r) in enumerate(results.items()):
        util = r.get("utilisation", {})
        xs = [j + i * width for j in range(len(stages))]
        ax.bar(xs, [util.get(s, 0.0) for s in stages], width, label=name, color=f"C{i}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))])
    ax.set_xticklabels(stages, rotation=30, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_title("per-stage utilisation")
