"""Run metrics: one JSON object per step in metrics.jsonl, and a compact progress line.

Metrics are data, kept apart from logs: the JSONL file is what plots and benchmarks read.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any

from rlhf_async.progress import Phase

PROGRESS_KEYS = (("reward", "rm"), ("hidden_score", "hidden"), ("kl", "kl"),
                 ("policy_loss", "pg"), ("value_loss", "vf"), ("entropy", "ent"),
                 ("response_length", "len"), ("samples_per_s", "smp/s"),
                 ("mfu/step", "mfu"), ("failed_steps", "failed"))
NONZERO_ONLY = {"failed_steps"}  # shown only when there is something to say


def progress_columns(rule_reward: bool, has_rule: bool) -> tuple[tuple[str, str], ...]:
    """The progress line's (record key, label) for a task: the reward is `rm` when a
    reward model makes it, else `reward` (a rule's, an environment's, an agent's); the
    hidden score only where it is not the reward itself (a rule beside a reward model)."""
    hidden = has_rule and not rule_reward
    return tuple(("reward", "reward" if rule_reward else "rm") if key == "reward" else
                 (key, label) for key, label in PROGRESS_KEYS
                 if key != "hidden_score" or hidden)


class MetricsWriter:
    """Appends one JSON line per record, flushed at once so a crash loses nothing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._f.write(json.dumps(record, sort_keys=True) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk: say where and how much is left
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.path.parent).free / 2**20
            raise OSError(e.errno, f"{e.strerror} writing {self.path} ({free:.0f} MiB free "
                                   "there); the checkpoints already written are intact",
                          str(self.path)) from None

    def close(self) -> None:
        self._f.close()


def truncate_jsonl(path: str | Path, step: int) -> None:
    """Drop the records of steps >= `step` (a run continuing from that step's checkpoint
    trains and logs them again)."""
    path = Path(path)
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        keep = [line for line in lines if json.loads(line).get("step", -1) < step]
        if len(keep) < len(lines):
            rewrite(path, "".join(line + "\n" for line in keep))


def rewrite(path: Path, text: str) -> None:
    """Replace a file's content all at once: a process killed meanwhile (a restarted
    trainer SIGKILLed in its first second) leaves the old file whole, never a truncated
    one (which lost every trained-sample record before the checkpoint, once in 7 chaos
    runs)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _complete_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file another process may be appending to: a last line
    still being written is left out."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def progress_metrics(record: dict[str, Any],
                     columns: tuple[tuple[str, str], ...] = PROGRESS_KEYS) -> dict[str, float]:
    """The few numbers of a step record that the progress line shows, by their short label."""
    return {label: record[key] for key, label in columns
            if key in record and (record[key] or key not in NONZERO_ONLY)}


def format_progress(record: dict[str, Any], total_steps: int,
                    columns: tuple[tuple[str, str], ...] = PROGRESS_KEYS) -> str:
    parts = [f"step {record['step'] + 1}/{total_steps}"]
    for label, v in progress_metrics(record, columns).items():
        parts.append(f"{label} {v}" if isinstance(v, int) else
                     f"{label} {v:.3f}" if abs(v) < 100 else f"{label} {v:.0f}")
    return " | ".join(parts)


def format_eval(record: dict[str, Any], hidden: bool = True) -> str:
    """The progress line of a step record's held-out evaluation (run.eval_every); its
    hidden score only where the task has one apart from the reward (`hidden`)."""
    parts = [f"eval after step {record['step'] + 1}"]
    for key, label in (("eval_hidden_score", "hidden"), ("eval_reward", "reward"),
                       ("eval_response_length", "len")):
        if key in record and (hidden or key != "eval_hidden_score"):
            parts.append(f"{label} {record[key]:.3f}")
    return " | ".join(parts) + (" (best so far, kept)" if record.get("eval_best") else "")


class Progress:
    """The RL phase's progress (`progress.Phase`): a bar with the step's key metrics on a
    terminal, a plain line every few seconds elsewhere. `start_step` counts as done (a
    resumed run); `columns` the task's (`progress_columns`)."""

    def __init__(self, total_steps: int, enabled: bool = True, stream: IO[str] | None = None,
                 start_step: int = 0,
                 columns: tuple[tuple[str, str], ...] = PROGRESS_KEYS) -> None:
        self.phase = Phase("rl", total_steps, enabled=enabled, stream=stream)
        self.phase.done = start_step
        self.columns = columns

    def update(self, record: dict[str, Any]) -> None:
        self.phase.update(1, **progress_metrics(record, self.columns))
        if "eval_reward" in record:
            self.phase.note(format_eval(record, any(k == "hidden_score"
                                                    for k, _ in self.columns)))

    def close(self) -> None:
        self.phase.close()


def summarize(records: list[dict[str, Any]], keys: tuple[str, ...], last: int = 5) -> dict:
    """Mean of each key over the first and the last `last` records."""
    out: dict[str, float] = {}
    for k in keys:
        vals = [r[k] for r in records if k in r]
        if vals:
            out[f"{k}_first"] = sum(vals[:last]) / len(vals[:last])
            out[f"{k}_last"] = sum(vals[-last:]) / len(vals[-last:])
    return out


def truncate_metrics(run_dir: Path, step: int, *, trainer_running: bool = False) -> None:
    """Before a run continues from the checkpoint of `step`: drop the records of steps at
    or after it (they are trained and logged again), and restore the record of any step
    before it that metrics.jsonl lacks from the trainer's own log (under Separation the
    coordinator writes metrics.jsonl from the trainer's report; a crash between the
    trainer's checkpoint and the coordinator's write must not lose the step's record).

    With `trainer_running` (a restarted trainer already has its log open) the trainer's
    log is only read: the trainer truncates it itself, and a rewrite here could replace
    the file under its open handle, losing every line it writes after (seen in a chaos
    run: the records of four trained steps gone)."""
    metrics, samples = run_dir / "metrics.jsonl", run_dir / "trained_samples.jsonl"
    truncate_jsonl(metrics, step)
    if not trainer_running:
        truncate_jsonl(samples, step)
    if not samples.exists():
        return
    have = {r["step"]: r for r in read_metrics(metrics)} if metrics.exists() else {}
    lost = {r["step"]: {"step": r["step"], **r["metrics"], "restored": True}
            for r in _complete_records(samples)
            if r["step"] < step and r["step"] not in have and "metrics" in r}
    if lost:
        records = sorted([*have.values(), *lost.values()], key=lambda r: r["step"])
        rewrite(metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
