"""Metrics beside RUN_DIR/metrics.jsonl: TensorBoard and Weights & Biases (`run.report_to`).

metrics.jsonl stays the record of a run (whichever process writes it: rank 0 of a
lock-step job, or the Separation coordinator). A `Reporter` in the job's process follows
that file and hands each new step's numbers to the sinks, so every strategy, a resumed run
and a multi-host one report alike. When a resume rewrites the file (steps after the
checkpoint are trained again) the reporter starts over from the new file and skips the
steps it sent already.

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


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
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

    def close(self) -> None:
        self.run.finish()


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


class Reporter:
    """Follows `metrics.jsonl` on a thread and reports each new step to every sink."""

    def __init__(self, run_dir: Path, sinks: list[Sink], poll_s: float = 0.5) -> None:
        self.path, self.sinks, self.poll_s = run_dir / "metrics.jsonl", sinks, poll_s
        self.sent: set[int] = set()
        self._offset, self._inode = 0, -1
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
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if stat.st_ino != self._inode or stat.st_size < self._offset:  # a new file
            self._inode, self._offset = stat.st_ino, 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a last line still being written waits
        self._offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step")
            if not isinstance(step, int) or step in self.sent:
                continue
            self.sent.add(step)
            values = numbers(record)
            for sink in self.sinks:
                try:
                    sink.log(step, values)
                except Exception as e:  # a reporting service must not stop training
                    log.warning("report_failed", sink=type(sink).__name__, error=str(e))

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        self.drain()
        for sink in self.sinks:
            sink.close()
