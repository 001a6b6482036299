"""ARCHITECTURE.md's layer tables as import contracts: every import of our own packages
(function-local and TYPE_CHECKING ones too) must point at the importer's own layer or at
one its row's "may import" cell allows, directly or through the rows it names.

    python .ci/layers.py [REPO]      exit 1 and one line per violation, else one summary line

A row's first cell names its members in backticks (`config/`, `log.py`, `nodes/common/`);
its "may import" cell is a comma list of other rows' names (a remark in parentheses is
skipped), or: `base` (the first row),
`nothing of ours`, `X and below` (X and every row above it in the table), `everything
above`, `the library` (every row of the first table). A module that no row names is an
error too: the tables must stay a map of the whole tree.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("rlhf_async", "nodes")
ENTRY = {"rlhf_async", "rlhf_async.__main__"}  # the package's own entry points: like cli/


@dataclass
class Layer:
    name: str
    members: list[str]  # dotted module prefixes
    allows: str  # the raw "may import" cell
    table: int
    may: set[str] = field(default_factory=set)  # layer names, closed over


def _member(cell: str, package: str) -> str:
    path = cell.strip("/").removesuffix(".py").replace("/", ".")
    return path if path.startswith("nodes") else f"{package}.{path}"


def parse(architecture: str) -> list[Layer]:
    """The rows of every table under '## Layers' whose header is `layer | holds | may import`."""
    section = architecture.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: list[Layer] = []
    table, in_table = 0, False
    for line in section.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "layer":
            table, in_table = table + 1, True
            continue
        if not in_table or set(cells[0]) <= {"-", " "}:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        members = [_member(n, "rlhf_async") for n in names]
        layers.append(Layer(names[0].strip("/").removesuffix(".py"), members, cells[-1], table))
    return layers


def _resolve(layers: list[Layer]) -> None:
    by_name = {m.split(".")[-1]: ly for ly in layers for m in ly.members}
    by_name |= {ly.name: ly for ly in layers}
    direct: dict[str, set[str]] = {}
    for i, ly in enumerate(layers):
        cell, names = re.sub(r"\([^)]*\)", "", ly.allows.replace("`", "")), set()
        first = [x for x in layers if x.table == 1]
        for part in (p.strip() for p in cell.split(",")):
            if part in ("", "nothing of ours"):
                continue
            if part == "base":
                names.add(first[0].name)
            elif part == "the library":
                names |= {x.name for x in first}
            elif part == "everything above":
                names |= {x.name for x in layers[:i] if x.table == ly.table}
            elif part.endswith(" and below"):
                top = by_name[part.removesuffix(" and below").strip("/")]
                names |= {x.name for x in layers[: layers.index(top) + 1] if x.table == top.table}
            elif part.strip("/") in by_name:
                names.add(by_name[part.strip("/")].name)
            else:
                raise SystemExit(f"ARCHITECTURE.md: layer {ly.name!r} may import {part!r}: "
                                 f"no row of that name ({', '.join(sorted(by_name))})")
        direct[ly.name] = names
    for ly in layers:  # what a layer may import, it may import through
        seen, todo = set(), list(direct[ly.name])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += direct[n]
        ly.may = seen | {ly.name}


def layer_of(module: str, layers: list[Layer]) -> Layer | None:
    best: tuple[int, Layer | None] = (-1, None)
    for ly in layers:
        for m in ly.members:
            if (module == m or module.startswith(m + ".")) and len(m) > best[0]:
                best = (len(m), ly)
    return best[1]


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import of one of PACKAGES in `path`, at any depth."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = module.split(".")[: -n.level if path.name != "__init__.py" else
                                          len(module.split(".")) - n.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.append((n.lineno, base))
    return [(ln, m) for ln, m in out if m.split(".")[0] in PACKAGES]


def check(repo: Path) -> tuple[list[str], int]:
    layers = parse((repo / "ARCHITECTURE.md").read_text())
    _resolve(layers)
    problems, count = [], 0
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            rel = path.relative_to(repo)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            if module in ENTRY or module == "nodes":
                continue
            src = layer_of(module, layers)
            if src is None:
                problems.append(f"{rel}: in no layer of ARCHITECTURE.md's tables")
                continue
            for line, target in imports(path, module):
                count += 1
                if package == "rlhf_async" and target.split(".")[0] == "nodes":
                    problems.append(f"{rel}:{line}: imports {target}: the library never "
                                    "imports nodes/")
                    continue
                dst = layer_of(target, layers)
                if target in PACKAGES or dst is None or dst.name in src.may:
                    continue
                problems.append(f"{rel}:{line}: {src.name} imports {target} ({dst.name}); "
                                f"ARCHITECTURE.md lets {src.name} import: "
                                f"{', '.join(sorted(src.may - {src.name})) or 'nothing'}")
    return problems, count


def main() -> int:
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    problems, count = check(repo)
    for p in problems:
        print(p)
    if problems:
        print(f"layers: {len(problems)} imports against ARCHITECTURE.md's layer tables")
        return 1
    print(f"layers: {count} imports of our own packages, all as ARCHITECTURE.md's tables allow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
