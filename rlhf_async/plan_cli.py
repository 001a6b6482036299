"""`rlhf-async plan`: the placement table and predicted cost of a config, the simulation
table for LLaMA-shaped models on GPU clusters, or a calibration run on this machine.
(The CLI may print; this module is the CLI's.)"""

from __future__ import annotations

import argparse
import json

from rlhf_async.config import ConfigError, load_config
from rlhf_async.costmodel import ASSUMPTIONS, DEVICES, LLAMA
from rlhf_async.planner import format_prediction, machine, plan_job, predictions, simulate


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
    if args.calibrate:
        from rlhf_async.calibrate import calibrate

        data = calibrate(cfg, args.out)
        print(json.dumps(data, indent=2) if args.json else
              f"calibration written to {args.out}; use it with "
              f"placement.calibration={str(args.out)!r}\n" +
              json.dumps(data["calibration"], indent=2))
        return 0
    placement, pred = plan_job(cfg)
    dev, cal = machine(cfg)
    if args.json:
        print(json.dumps({"placement": placement.to_dict(), "step_s": pred.step_s,
                          "phases": pred.phases, "memory_bytes": pred.memory,
                          "notes": pred.notes}, indent=2))
        return 0
    print(placement.table())
    print()
    print(format_prediction(pred, dev, cal))
    others = [f"  {n}: {pr.step_s * 1e3:.1f} ms" if pr else f"  {n}: not possible ({why})"
              for n, (_, pr, why) in predictions(cfg).items()]
    print("predicted step time of each strategy on this config:\n" + "\n".join(others))
    return 0


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
    """Markdown table: step time per strategy, speed-up over Flattening, peak memory."""
    dev = DEVICES[gpu]
    out = [f"Predicted RLHF step time on {dev.name} (PPO: actor, critic, reward, reference)",
           "", "Assumptions:"] + [f"- {a}" for a in ASSUMPTIONS] + [""]
    out.append("| model | GPUs | strategy | step s | generate | score | train | sync | "
               "peak GiB/GPU | vs flattening | layout / notes |")
    out.append("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    flat = {(r["model"], r["gpus"]): r["step_s"] for r in rows if r["strategy"] == "flattening"}
    for r in rows:
        ph = r["phases"]
        base = flat.get((r["model"], r["gpus"]))
        ok = r["feasible"]
        vs = f"{base / r['step_s']:.1f}x" if ok and base and base != float("inf") else "-"
        step = f"{r['step_s']:.1f}" if ok else "OOM"
        note = r["layout"] or ("; ".join(r["notes"][1:2]) if ok else r["notes"][-1])
        out.append(f"| {r['model']} | {r['gpus']} | {r['strategy']} | {step} | "
                   f"{ph['generate']:.1f} | {ph['score']:.1f} | {ph['train']:.1f} | "
                   f"{ph['sync']:.1f} | {r['memory_gib']:.0f} | {vs} | {note} |")
    return "\n".join(out)
