"""Writes prompts.jsonl: the guessing game `server.py` plays, described in 128 ways (an
opening, the rules, how to answer); the run holds about one in eight out, so the
held-out prompts are the same game in wordings it did not train on
(`python examples/openenv_guess/make_prompts.py`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

OPENINGS = ["Let's play a guessing game.", "Guessing game time!", "I have a secret digit.",
            "Play a number game with me.", "Here is a little puzzle.", "Try to read my mind.",
            "A quick game for you.", "Let us play higher or lower."]
RULES = ["I pick a digit from 0 to 9; after each guess I say higher or lower.",
         "My digit is between 0 and 9, and I tell you higher or lower after every guess.",
         "Guess my digit (0-9) in three tries; I answer higher, lower or correct.",
         "You have three guesses to find my digit from 0 to 9, with a hint after each."]
ASKS = ["Reply with one digit only.", "Answer with just the digit, nothing else.",
        "Say a single digit.", "Each answer is one digit."]


def main() -> None:
    rows = [{"prompt": " ".join(p)} for p in itertools.product(OPENINGS, RULES, ASKS)]
    out = Path(__file__).with_name("prompts.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
