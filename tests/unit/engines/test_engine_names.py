"""No file of the library or the node programs names a generation engine except the
engines' own package (not even the config schema, which takes any name and leaves the
check to the registry): adding an engine is one module and one registry line, and every
other message says "the engine" or takes the name from the registry."""

from __future__ import annotations

import re
from pathlib import Path

from rlhf_async.engines import ENGINES, engine_capabilities

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = ("rlhf_async/engines/",)
# "torch" is also the tensor library's name, so only the other engines are searched for;
# nor is "sim": the simulated devices' kind (placement.device, the [sim] section) has the
# name of the one engine that runs on it (chosen by its capabilities' devices, never by
# name); SGLang is the engine the interface names as next
NAMES = sorted({n for n in ENGINES if n != "torch"
                and engine_capabilities(n).devices != (n,)} | {"sglang"})


def _hits(root: Path) -> list[str]:
    pattern = re.compile("|".join(map(re.escape, NAMES)), re.IGNORECASE)
    out = []
    for top in ("rlhf_async", "nodes"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(ALLOWED):
                continue
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    out.append(f"{rel}:{no}: {line.strip()}")
    return out


def test_no_engine_name_outside_the_engines_package():
    assert "vllm" in NAMES  # the search covers the registered engines
    assert _hits(ROOT) == []


def test_the_search_finds_a_name_in_any_case(tmp_path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "rlhf_async" / "engines").mkdir(parents=True)
    (tmp_path / "nodes" / "x.py").write_text('"""served by vLLM"""\nok = 1\n# SGLang next\n')
    (tmp_path / "rlhf_async" / "engines" / "y.py").write_text("import vllm\n")
    assert _hits(tmp_path) == ['nodes/x.py:1: """served by vLLM"""', "nodes/x.py:3: # SGLang next"]
