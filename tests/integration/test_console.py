"""What a person sees on the console of a run, end to end through the CLI (stderr not a
terminal, as when it is piped): one short human line per event, never a JSON record;
first what `auto` decided (the generation engine and why); and every record as JSON in
RUN_DIR/logs (the job's `job.log`, a lock-step rank's `rankR.log`). The agent here fails
the episodes of half its prompts, as a broken agent's would be logged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
AGENT = f"""
import importlib.util
spec = importlib.util.spec_from_file_location(
    "builtin_agent", {str(ROOT / "examples" / "calculator_agent" / "builtin.py")!r})
builtin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builtin)


async def run(base_url, row):
    if int(row["prompt"][0]) % 2:
        raise ValueError("an odd first digit, on purpose " + "x" * 300)
    return await builtin.run(base_url, row)
"""


def _run(tmp_path: Path, cache: Path, name: str, *over: str) -> tuple[str, Path]:
    (tmp_path / "agent.py").write_text(AGENT)
    p = subprocess.run(
        [sys.executable, "-m", "rlhf_async", "run", "task.name=calculator",
         f"task.agent={tmp_path / 'agent.py'}:run", "train.steps=2",
         "train.prompts_per_step=4", "run.eval_prompts=8", "run.plot=false",
         f"run.cache_dir={json.dumps(str(cache))}", f"run.output_dir={tmp_path}",
         f"run.name={name}", "placement.cpu_threads=1", *over],
        capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr, tmp_path / name


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_console(err: str) -> list[str]:
    lines = err.splitlines()
    assert not [x for x in lines if x.lstrip().startswith("{")], err[-3000:]
    assert all(len(x) <= 240 for x in lines), max(lines, key=len)
    assert "leaked semaphore" not in err  # a rank that exits at once holds no tqdm lock
    (engine,) = [x for x in lines if x.startswith("[engine]")]
    assert engine.startswith("[engine] generation.backend = auto chose torch: the built-in "
                             "model")
    failed = [x for x in lines if "agent episode failed" in x]
    assert failed and all(x.startswith("[episodes] warning: agent episode failed: error=run() "
                                       "raised ValueError: an odd first digit") for x in failed)
    assert not [x for x in lines if "agent endpoint listening" in x]  # info: the file's
    return lines


def test_one_process_run_console_lines_and_its_log_file(tmp_path, cache):
    err, run_dir = _run(tmp_path, cache, "one")
    lines = _check_console(err)
    assert lines.index(next(x for x in lines if x.startswith("[engine]"))) < \
        lines.index(next(x for x in lines if x.startswith("[rl")))
    records = _records(run_dir / "logs" / "job.log")
    events = [r["event"] for r in records]
    assert "agent endpoint listening" in events
    (engine,) = [r for r in records if r["event"] == "auto engine"]
    assert engine["backend"] == "torch" and "built-in model" in engine["why"]
    (first,) = [r for r in records if r["event"] == "agent episode failed" and r["count"] == 1]
    line = AGENT.splitlines().index(next(x for x in AGENT.splitlines() if "raise" in x)) + 1
    assert first["error"].endswith("x" * 300 + f" (at {tmp_path / 'agent.py'}:{line})")


def test_lock_step_ranks_say_the_same_lines_and_keep_their_records(tmp_path, cache):
    """Rank processes printed structlog's default: every info record, on stdout."""
    err, run_dir = _run(tmp_path, cache, "two", "placement.devices=2")
    _check_console(err)
    for rank in (0, 1):
        events = [r["event"] for r in _records(run_dir / "logs" / f"rank{rank}.log")]
        assert "agent endpoint listening" in events and "agent episode failed" in events
