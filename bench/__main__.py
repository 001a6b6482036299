"""The benchmark suite's one entry point.

    python -m bench list                 every benchmark: what docs claim it backs, its results
    python -m bench run NAME [ARGS ...]  run one (ARGS are its own: `run NAME --help`)

Each benchmark writes its summary under bench/results/ with a `meta` block (bench/output.py);
bench/README.md has today's number per benchmark and how it was measured.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.suite import BENCHMARKS, Benchmark

ROOT = Path(__file__).resolve().parents[1]
USAGE = "usage: python -m bench list | python -m bench run NAME [ARGS ...]"


def command(b: Benchmark, args: list[str]) -> list[str]:
    """How `run` starts a benchmark: its module under this interpreter, or its shell script."""
    if b.script.endswith(".sh"):
        return ["bash", str(ROOT / "bench" / b.script), *args]
    return [sys.executable, "-m", f"bench.{b.script.removesuffix('.py')}", *args]


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    rows = []
    for b in BENCHMARKS.values():
        rows.append(f"{b.name:{width}}  {b.backs}")
        where = ", ".join(f"bench/results/{r}" for r in b.results) or "prints its numbers"
        rows.append(f"{'':{width}}  bench/{b.script} -> {where}; README: \"{b.section}\"")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return 0 if argv else 2
    if argv[0] == "list" and len(argv) == 1:
        print(listing())
        return 0
    if argv[0] == "run" and len(argv) >= 2:
        b = BENCHMARKS.get(argv[1])
        if b is None:
            print(f"python -m bench run: no benchmark named {argv[1]!r}; the names are: "
                  f"{', '.join(BENCHMARKS)} (python -m bench list)", file=sys.stderr)
            return 2
        print(f"== {b.name}: {b.backs}", file=sys.stderr, flush=True)
        return subprocess.run(command(b, argv[2:])).returncode
    print(f"python -m bench: cannot read {' '.join(argv)!r}. {USAGE} (the strategies "
          "benchmark that `python -m bench` ran before is `python -m bench run strategies`)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
