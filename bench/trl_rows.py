"""The rows `bench.trl_compare` and `bench.trl_text` choose from: the model sizes, our
strategies' overrides (fp32, compiled decode, bf16 variants) and TRL's rows (threads, bf16,
subnormals flushed)."""

from __future__ import annotations

import argparse

SIZES = {"2x64": (2, 64, 4), "4x128": (4, 128, 4), "6x384": (6, 384, 6)}
OURS = {"flattening": ["placement.strategy=flattening"],
        "separation k=1": ["placement.strategy=separation", "algo.max_staleness=1"]}
# with --compiled, and with the compiled decode step, which `generation.compile = auto` picks
# for a job of >= 20,000 decode steps (this bench's are shorter; its compile falls in the
# warm-up steps)
OURS_COMPILED = {"separation k=1 compiled": [*OURS["separation k=1"], "generation.compile=on"]}
# with --bf16 (TRL's default precision): every model computes in bf16; trained ones under
# autocast over fp32 master weights, frozen ones and the shadow actor held in bf16
BF16 = ['placement.dtype=["actor=bf16","shadow_actor=bf16","reward=bf16","reference=bf16"]']
OURS_BF16 = {f"{name} bf16": [*over, *BF16] for name, over in OURS.items()}
# and the same with generation in fp32 (on CPU, bf16 matmuls gain only from ~384 wide and
# the narrow models' decode steps lose to its casts): the shadow actor stays at fp32
TRAIN_SCORE_BF16 = 'placement.dtype=["actor=bf16","reward=bf16","reference=bf16"]'
OURS_BF16["flattening bf16 gen-fp32"] = [*OURS["flattening"], TRAIN_SCORE_BF16,
                                         "generation.dtype=fp32"]
OURS_BF16["separation k=1 bf16 gen-fp32"] = [*OURS["separation k=1"], TRAIN_SCORE_BF16]
# and with the scorer beside the trainer (device 0), where training leaves that core idle
OURS_BF16["separation k=1 bf16 scorer@trainer"] = [*OURS_BF16["separation k=1 bf16"],
                                                  "placement.reward=[0]",
                                                  "placement.reference=[0]"]


def trl_rows(args: argparse.Namespace) -> list[tuple[str, int, bool, bool]]:
    """(row name, torch threads, bf16, subnormals flushed): fp32 like our side at every
    --trl-threads count, and with --trl-bf16 or --bf16 also TRL's own default (bf16 autocast)
    at the largest count; with --trl-flush-denormal every row flushes subnormal floats to zero
    (" ftz"), as ours does by default (`placement.flush_denormal`)."""
    ftz = getattr(args, "trl_flush_denormal", False)  # (flags trl_text does not have: off)
    tag = " ftz" if ftz else ""
    rows = [(f"trl {n}t{tag}", n, False, ftz) for n in args.trl_threads]
    if args.trl_bf16 or args.bf16:
        n = max(args.trl_threads)
        rows.append((f"trl {n}t bf16{tag}", n, True, ftz))
    return rows


def our_rows(args: argparse.Namespace) -> list[str]:
    """Our rows: fp32, with --compiled also Separation's with the compiled decode step, and
    with --bf16 the same strategies in bf16."""
    compiled = getattr(args, "compiled", False)
    return [*OURS, *(OURS_COMPILED if compiled else {}), *(OURS_BF16 if args.bf16 else {})]
