"""Metrics beside RUN_DIR/metrics.jsonl: TensorBoard and Weights & Biases (`run.report_to`).

metrics.jsonl stays the record of a run (whichever process writes it: rank 0 of a
lock-step job, or the Separation coordinator). A `Reporter` in the job's process follows
that file and hands each new step's numbers to the sinks, so every strategy, a resumed run
and a multi-host one report alike; it follows RUN_DIR/samples.jsonl (`task/samples.py`) the
same way, each step's samples as a text table (TensorBoard) or a `wandb.Table`. When a
resume rewrites a file (steps after the checkpoint are trained again) the reporter starts
over from the new file and skips the steps it sent already.

    tensorboard  RUN_DIR/tensorboard/ (extra `[tensorboard]`; `tensorboard --logdir runs`)
    wandb        a W&B run named like the run directory, files under RUN_DIR/wandb
                 (extra `[wandb]`; WANDB_MODE=offline works without a network)
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Protocol

from rlhf_async.log import get_logger

log = get_logger(component="reporting")


SAMPLE_COLUMNS = ("prompt", "response", "reward", "advantage", "version")


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + " --- |" * len(SAMPLE_COLUMNS)
        lines = ["| " + " | ".join(_cell(r.get(c)) for c in SAMPLE_COLUMNS) + " |"
                 for r in rows]
        self.writer.add_text("samples", "\n".join([head, *lines]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project="rlhf-async", name=run_dir.name, dir=str(run_dir),
                              config=config, resume="allow", id=run_dir.name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=["step", *SAMPLE_COLUMNS],
                            data=[[step, *(r.get(c) for c in SAMPLE_COLUMNS)] for r in rows])
        # joins the row W&B has open (it refuses a step older than its current one, and a
        # committed row of its own would move its step past the next metrics record's)
        self.run.log({"samples": table}, commit=False)

    def close(self) -> None:
        self.run.finish()


def _cell(value: Any) -> str:
    """A markdown table cell: numbers short, text with its pipes and newlines escaped."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of one metrics record (nested ones as a/b), without its step."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in numbers(value).items()})
    return out


class _Tail:
    """The complete JSON lines appended to a file since the last read (from the start
    again when the file was replaced: a resume rewrites it)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.inode = path, 0, -1

    def records(self) -> list[dict[str, Any]]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self.inode or stat.st_size < self.offset:  # a new file
            self.inode, self.offset = stat.st_ino, 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a last line still being written waits
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out


class Reporter:
    """Follows `metrics.jsonl` (and `samples.jsonl`) on a thread and reports each new step
    to every sink, once."""

    def __init__(self, run_dir: Path, sinks: list[Sink], poll_s: float = 0.5) -> None:
        self.path, self.sinks, self.poll_s = run_dir / "metrics.jsonl", sinks, poll_s
        self.sent: set[int] = set()
        self.sent_samples: set[int] = set()
        self._metrics, self._samples = _Tail(self.path), _Tail(run_dir / "samples.jsonl")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="metrics-reporter",
                                        daemon=True)

    @classmethod
    def start(cls, run_dir: Path, names: list[str], config: dict[str, Any]) -> Reporter | None:
        if not names:
            return None
        sinks: list[Sink] = []
        for name in names:
            sinks.append(TensorBoardSink(run_dir) if name == "tensorboard"
                         else WandbSink(run_dir, config))
        reporter = cls(run_dir, sinks)
        reporter._thread.start()
        return reporter

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.drain()

    def drain(self) -> None:
        """Report every complete line written since the last call."""
        for record in self._metrics.records():
            if record["step"] not in self.sent:
                self.sent.add(record["step"])
                self._each("log", record["step"], numbers(record))
        for record in self._samples.records():
            if record["step"] not in self.sent_samples and record.get("samples"):
                self.sent_samples.add(record["step"])
                self._each("log_samples", record["step"], record["samples"])

    def _each(self, method: str, step: int, payload: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(step, payload)
            except Exception as e:  # a reporting service must not stop training
                log.warning("report_failed", sink=type(sink).__name__, error=str(e))

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        self.drain()
        for sink in self.sinks:
            sink.close()
