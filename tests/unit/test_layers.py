"""ARCHITECTURE.md's layer tables are checked, not wished: `.ci/layers.py` passes on this
tree and fails, naming the file and line, on a deliberate violation in a scratch copy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _check(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / ".ci" / "layers.py"), str(repo)],
                          capture_output=True, text=True, timeout=60)


def _scratch(tmp_path: Path) -> Path:
    for name in ("rlhf_async", "nodes"):
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "ARCHITECTURE.md", tmp_path)
    return tmp_path


def test_this_tree_keeps_its_layers():
    done = _check(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all as ARCHITECTURE.md's tables allow" in done.stdout


def test_an_import_up_the_layers_fails_with_its_file_and_line(tmp_path):
    repo = _scratch(tmp_path)
    protocol = repo / "rlhf_async" / "wire" / "protocol.py"
    lines = protocol.read_text().splitlines()
    # a function-local import counts as much as a top-level one
    protocol.write_text("\n".join([*lines, "", "", "def _up():",
                                   "    from rlhf_async.strategies import placement",
                                   "    return placement", ""]))
    done = _check(repo)
    assert done.returncode == 1, done.stdout
    assert (f"rlhf_async/wire/protocol.py:{len(lines) + 4}: wire imports "
            "rlhf_async.strategies (strategies)") in done.stdout
    assert "1 imports against" in done.stdout


def test_a_module_in_no_layer_and_the_library_importing_nodes_fail(tmp_path):
    repo = _scratch(tmp_path)
    (repo / "rlhf_async" / "extras_of_mine").mkdir()
    (repo / "rlhf_async" / "extras_of_mine" / "__init__.py").write_text("")
    (repo / "rlhf_async" / "metrics.py").write_text(
        (repo / "rlhf_async" / "metrics.py").read_text() + "\nimport nodes.trainer.main\n")
    done = _check(repo)
    assert done.returncode == 1
    assert "rlhf_async/extras_of_mine/__init__.py: in no layer" in done.stdout
    assert "imports nodes.trainer.main: the library never imports nodes/" in done.stdout


def test_a_row_naming_no_layer_is_an_error(tmp_path):
    repo = _scratch(tmp_path)
    arch = repo / "ARCHITECTURE.md"
    arch.write_text(arch.read_text().replace("| runtime |", "| runtimes |", 1))
    done = _check(repo)
    assert done.returncode != 0 and "may import 'runtimes': no row of that name" in (
        done.stdout + done.stderr)


def test_one_node_program_never_imports_another(tmp_path):
    repo = _scratch(tmp_path)
    main = repo / "nodes" / "scorer" / "main.py"
    main.write_text(main.read_text() + "\nfrom nodes.trainer import assembler\n")
    done = _check(repo)
    assert done.returncode == 1 and "nodes/scorer imports nodes.trainer (nodes/trainer)" in (
        done.stdout)


def test_a_node_program_importing_the_coordinator_side_fails(tmp_path):
    """nodes/ stands beside strategies/: both import what they share from pipeline/."""
    repo = _scratch(tmp_path)
    main = repo / "nodes" / "trainer" / "main.py"
    main.write_text(main.read_text() + "\nfrom rlhf_async.strategies.separation import driver\n")
    done = _check(repo)
    assert done.returncode == 1, done.stdout
    assert "nodes/trainer imports rlhf_async.strategies.separation (strategies)" in done.stdout
