"""`rlhf-async plan`: the placement table and predicted cost of a config, the simulation
table for LLaMA-shaped models on GPU clusters, or a calibration run on this machine.
(The CLI may print; this module is the CLI's.)"""

from __future__ import annotations

import argparse
import json

from rlhf_async.config import ConfigError, load_config
from rlhf_async.engines import generation_engine
from rlhf_async.planning.calibrate import calibrate
from rlhf_async.planning.costmodel import ASSUMPTIONS, DEVICES, LLAMA
from rlhf_async.planning.planner import format_prediction, machine, plan_job, predictions, simulate
from rlhf_async.strategies.placement import Placement, with_engines
from rlhf_async.strategies.registry import STRATEGIES


def _int_list(text: str, key: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ConfigError([f"{key}: {text!r} is not a comma list of positive integers"])
    return out


def run_plan(args: argparse.Namespace, config: str | None, overrides: list[str]) -> int:
    if args.simulate:
        return _simulate(args)
    cfg = load_config(config, overrides)
    if args.twin:
        from rlhf_async.cli.plan_twin import run_twin  # starts a job: torch and its nodes

        return run_twin(cfg, args.steps, args.json)
    if args.calibrate:
        data = calibrate(cfg, args.out)
        print(json.dumps(data, indent=2) if args.json else
              f"calibration written to {args.out}; use it with "
              f"placement.calibration={str(args.out)!r}\n" +
              json.dumps(data["calibration"], indent=2))
        return 0
    placement, pred = plan_job(cfg)
    placement = with_engines(placement, cfg.train.backend, generation_engine(cfg))
    dev, cal = machine(cfg)
    if args.json:
        print(json.dumps({"placement": placement.to_dict(), "step_s": pred.step_s,
                          "phases": pred.phases, "memory_bytes": pred.memory,
                          "activation_bytes": pred.activations,
                          "notes": pred.notes}, indent=2))
        return 0
    print(placement.table())
    print()
    print(format_prediction(pred, dev, cal))
    others = [f"  {n}: {pr.step_s * 1e3:.1f} ms{_split(p)}" if p and pr
              else f"  {n}: not possible ({why})"
              for n, (_, p, pr, why) in predictions(cfg).items()]
    print("predicted step time of each strategy on this config:\n" + "\n".join(others))
    return 0


def _split(p: Placement) -> str:
    """The stage sizes of a strategy with stages (Separation's), as `auto` balances them."""
    strategy = STRATEGIES[p.strategy]
    if strategy.lock_step:
        return ""
    sizes = {r: len(p.by_role(r)) for r in strategy.roles}
    return " (" + ", ".join(f"{r} x{k}" for r, k in sizes.items()) + ")"


def _simulate(args: argparse.Namespace) -> int:
    models = [m.strip().upper() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in LLAMA]
    if bad or not models:
        raise ConfigError([f"--models: {bad or args.models!r} not among {', '.join(LLAMA)}"])
    sizes = _int_list(args.gpus, "--gpus")
    rows = simulate(args.gpu, models, sizes)
    if args.json:
        print(json.dumps({"gpu": args.gpu, "assumptions": ASSUMPTIONS, "rows": rows}, indent=1))
        return 0
    print(format_simulation(rows, args.gpu))
    return 0


def format_simulation(rows: list[dict], gpu: str) -> str:
    """Markdown table, one row per (model, GPUs): each strategy's predicted step time and
    peak memory per GPU (OOM: no layout fits; refused: no layout this build's runners
    execute), the speed-up of each over the first (Flattening), and the best layout of
    each strategy with stages (Separation's)."""
    dev = DEVICES[gpu]
    out = [f"Predicted PPO step time on {dev.name} (actor, critic, reward, reference)",
           "", "Assumptions:"] + [f"- {a}" for a in ASSUMPTIONS] + [""]
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    short = {r["strategy"]: (STRATEGIES[r["name"]].short or r["name"]) +
             ("" if STRATEGIES[r["name"]].lock_step else f" k={r['k']}") for r in rows}
    first, rivals = names[0], names[1:]
    staged = list(dict.fromkeys(r["strategy"] for r in rows
                                if not STRATEGIES[r["name"]].lock_step and r["k"] == 0))
    out.append("| model | GPUs | " + " | ".join(f"{n} s (GiB)" for n in names) + " | "
               + " | ".join(f"{short[n]} vs {short[first]}" for n in rivals) + " | "
               + " | ".join(f"{n.removesuffix(' k=0')} layout (k=0)" for n in staged) + " |")
    out.append("| --- | ---: | " + " | ".join("---:" for _ in names + rivals) + " | "
               + " | ".join("---" for _ in staged) + " |")
    by = {(r["model"], r["gpus"], r["strategy"]): r for r in rows}
    for model, n in dict.fromkeys((r["model"], r["gpus"]) for r in rows):
        cells, step = [], {}
        for name in names:
            r = by[(model, n, name)]
            step[name] = r["step_s"] if r["feasible"] else None
            cells.append(f"{r['step_s']:.1f} ({r['memory_gib']:.0f})" if r["feasible"]
                         else f"OOM ({r['memory_gib']:.0f})" if r["runnable"] else "refused")
        base = step[first]
        cells += [f"{base / step[k]:.1f}x" if base and step[k] else "-" for k in rivals]
        cells += [by[(model, n, k)]["layout"] for k in staged]
        out.append(f"| {model} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)
