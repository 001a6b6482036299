"""`rlhf-async plan --twin CONFIG`: the user's job (model shape, GPUs, strategy) run for a
few steps on simulated devices (docs/howto/twin.md), its measured stage utilisation, queue
depths, staleness and samples/s printed beside the cost model's plan of the same job.
(The CLI may print; this module is the CLI's.)"""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlhf_async import job
from rlhf_async.config import ConfigError, JobConfig
from rlhf_async.metrics import read_metrics
from rlhf_async.planning.planner import plan_job

ROLES = {"gen": "generator", "scorer": "scorer", "trainer": "trainer"}
WARMUP = 2  # steps left out of the medians: start-up and the first weight broadcast


def run_twin(cfg: JobConfig, steps: int, as_json: bool) -> int:
    if cfg.placement.device != "sim":
        raise ConfigError(["plan --twin: runs the job on simulated devices; set "
                           "placement.device = 'sim' and train.backend = 'sim' (and the "
                           "[sim] section: docs/howto/twin.md)"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    _, pred = plan_job(cfg)  # every problem before any process starts
    summary = job.run(cfg, io.StringIO())
    records = read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
    measured = measure(records)
    analytical = {"step_s": pred.step_s, "samples_per_s": pred_samples(cfg, pred.step_s),
                  "phases_s": pred.phases}
    if as_json:
        print(json.dumps({"run_dir": summary["run_dir"], "twin": measured,
                          "plan": analytical, "notes": pred.notes}, indent=1))
        return 0
    print(format_twin(cfg, measured, analytical, summary["run_dir"]))
    return 0


def pred_samples(cfg: JobConfig, step_s: float) -> float:
    return cfg.train.prompts_per_step * cfg.algo.group_size / step_s


def _median(records: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return statistics.median(vals) if vals else float("nan")


def measure(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps after the warm-up: simulated step time and samples/s, each
    role's mean utilisation, the queue depths, staleness, and the control plane's real
    cost per step."""
    steady = records[WARMUP:] or records
    util: dict[str, list[float]] = defaultdict(list)
    for r in steady:
        by_role: dict[str, list[float]] = defaultdict(list)
        for k, v in r.items():
            if k.startswith("util/"):
                node = k.removeprefix("util/")
                role = next((ROLES[p] for p in ROLES if node.startswith(p)), node)
                by_role[role].append(v)
        for role, vs in by_role.items():
            util[role].append(sum(vs) / len(vs))
    queues = sorted({k for r in steady for k in r if k.startswith("queue/")})
    return {"steps": len(records), "step_s": _median(steady, "time_step"),
            "samples_per_s": _median(steady, "samples_per_s"),
            "utilisation": {role: statistics.median(vs) for role, vs in util.items()},
            "queues": {q.removeprefix("queue/"): _median(steady, q) for q in queues},
            "staleness_mean": _median(steady, "staleness/mean"),
            "dropped_stale": steady[-1].get("staleness/dropped_total", 0) if steady else 0,
            "control_real_s": _median(steady, "control/real_s"),
            "control_share": _median(steady, "control/share"),
            "real_step_s": _median(steady, "real/time_step")}


def format_twin(cfg: JobConfig, m: dict[str, Any], plan: dict[str, Any], run_dir: str) -> str:
    s = cfg.sim
    out = [f"twin of {cfg.placement.strategy}: LLaMA-{s.model} on {cfg.placement.devices} "
           f"simulated {cfg.placement.gpu}s, {m['steps']} steps (time scale {s.time_scale}; "
           f"medians after {WARMUP} warm-up steps; run {run_dir})", "",
           "|  | twin (measured) | plan (analytical) |", "| --- | ---: | ---: |",
           f"| step time (simulated s) | {m['step_s']:.2f} | {plan['step_s']:.2f} |",
           f"| samples/s | {m['samples_per_s']:.2f} | {plan['samples_per_s']:.2f} |"]
    out += [f"| {phase} (s) | | {t:.2f} |" for phase, t in plan["phases_s"].items()]
    out += [f"| utilisation: {role} | {u:.2f} | |" for role, u in m["utilisation"].items()]
    out += [f"| queue: {q} (chunks) | {d:.1f} | |" for q, d in m["queues"].items()]
    out += [f"| staleness (versions, mean) | {m['staleness_mean']:.2f} | |",
            f"| dropped as stale (all steps) | {m['dropped_stale']:.0f} | |", "",
            f"control plane: {m['control_real_s']:.3f} real s of CPU per step "
            f"({100 * m['control_share']:.2f}% of a simulated step); real time per step "
            f"{m['real_step_s']:.2f} s"]
    return "\n".join(out)
