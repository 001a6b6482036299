"""Writes prompts.jsonl: `What is a*b?` with its answer, two-digit operands as the built-in
calculator task draws them (`python examples/calculator_agent/make_prompts.py`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf_async.task.calculator import OPERANDS


def main(count: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        rows.append({"prompt": f"What is {a}*{b}?", "answer": str(a * b)})
    out = Path(__file__).with_name("prompts.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
