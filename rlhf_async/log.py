"""Logging: structlog, bound with role and node id, to two sinks.

The console (stderr) is for people: one short line per event (`[component] warning: event:
key=value ...`), written above a terminal's progress bar; or JSON lines where stderr is a
file (`json=True`, or by default when stderr is not a terminal: a node process's stderr is
its log file). An event that says what the run decided carries `console="sentence"`: on a
human console that sentence is its line, shown at the default level (it counts as a
warning there) though logged at info.

The run's log file (`log_to_file`, RUN_DIR/logs/job.log while a job holds its directory)
keeps every record at info and above as JSON, with every field whole; the records logged
before the job knew its directory (the engine `auto` chose, ...) are written first.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import structlog
from tqdm import tqdm

CONSOLE = "console"  # the event field holding a decision's sentence for people
FILE_LEVEL = logging.INFO
EARLY = 500  # records kept for a log file not opened yet
VALUE_CHARS, LINE_CHARS = 160, 240
# fields a human line leaves out (the bracket names the component) or puts first
_UNSAID = ("event", "level", "timestamp", "component", "role", "node_id", "exception",
           CONSOLE)
_FIRST = ("error", "reason", "why")


class _CurrentStderr:
    """Writes to whatever sys.stderr is now, so a replaced (or captured, then closed)
    stream never leaves loggers writing to a dead file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _level(name: str | None) -> int:
    return logging.getLevelNamesMapping().get(str(name).upper(), logging.INFO)


class _Sinks:
    """The last processor: renders each event for the console and the run's file, writes
    both, and drops the event (structlog's own printing is not used)."""

    def __init__(self, console_level: int, json: bool) -> None:
        self.console_level, self.json = console_level, json
        self.file: IO[str] | None = None
        self.pid = os.getpid()  # the file's owner: a forked child writes none of its own
        self.decisions = True  # a decision's sentence shows (the job's run.progress)
        self.early: deque[str] = deque(maxlen=EARLY)
        self.lock = threading.Lock()
        self.render = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, name: str,
                 event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        say = event.pop(CONSOLE, None)
        level = _level(event.get("level", "info"))
        record = str(self.render(logger, name, event))
        with self.lock:
            if level >= FILE_LEVEL:
                if self.file is not None and self.pid == os.getpid():
                    self.file.write(record + "\n")
                    self.file.flush()
                else:
                    self.early.append(record)
            if self.json:
                if level >= self.console_level:
                    sys.stderr.write(record + "\n")
                    sys.stderr.flush()
            elif level >= self.console_level or (
                    say and self.decisions and max(level, logging.WARNING) >= self.console_level):
                _write_line(human_line(event, say))
        raise structlog.DropEvent

    def attach(self, path: Path, decisions: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self._close()
            self.decisions, self.pid = decisions, os.getpid()
            self.file = path.open("a", encoding="utf-8")
            self.file.writelines(r + "\n" for r in self.early)
            self.file.flush()
            self.early.clear()

    def detach(self) -> None:
        with self.lock:
            self._close()
            self.decisions = True

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _write_line(line: str) -> None:
    """Above a terminal's progress bars if there are some (tqdm's lock is a semaphore a
    rank process that exits at once would leak, so it is taken only then)."""
    if getattr(tqdm, "_instances", None):
        tqdm.write(line, file=sys.stderr)
    else:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _short(value: Any, chars: int = VALUE_CHARS) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= chars else text[:chars - 3] + "..."


def human_line(event: MutableMapping[str, Any], say: str | None = None) -> str:
    """One line for people: `[component] warning: event: key=value ...` (a decision: its
    sentence), values and the line cut short; an exception as its last line."""
    where = event.get("component") or event.get("node_id") or event.get("role") or "rlhf-async"
    if say:
        return _short(f"[{where}] {say}", LINE_CHARS)
    level = str(event.get("level", "info"))
    head = f"[{where}] " + ("" if level in ("info", "debug") else f"{level}: ")
    keys = [k for k in _FIRST if k in event] + \
        [k for k in event if k not in _FIRST and k not in _UNSAID]
    fields = " ".join(f"{k}={_short(event[k])}" for k in keys)
    line = f"{head}{event.get('event', '')}" + (f": {fields}" if fields else "")
    if event.get("exception"):
        line += f" ({_short(str(event['exception']).strip().splitlines()[-1])})"
    return _short(line, LINE_CHARS)


_SINKS: list[_Sinks] = []


def _after_fork_in_child() -> None:
    for sinks in _SINKS:  # a lock another thread held at the fork would never be released
        sinks.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog for this process (again: the latest call wins; a job's open
    log file stays open).

    `json=None` picks JSON lines when stderr is not a terminal (deployments, node
    processes whose stderr goes to a file) and human lines otherwise; the CLI's job
    commands pass False (their JSON goes to the run's log file)."""
    numeric = _level(level or os.environ.get("RLHF_ASYNC_LOG_LEVEL", "info"))
    if json is None:
        json = not sys.stderr.isatty()
    sinks = _Sinks(numeric, json)
    if _SINKS and _SINKS[0].pid == os.getpid():
        sinks.file, sinks.decisions = _SINKS[0].file, _SINKS[0].decisions
    _SINKS[:] = [sinks]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            sinks,
        ],
        # info and up are rendered whatever the console shows: the run's file keeps them
        wrapper_class=structlog.make_filtering_bound_logger(min(numeric, FILE_LEVEL)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]  # a TextIO by duck typing
        cache_logger_on_first_use=False,
    )


def console_settings() -> tuple[str, bool]:
    """This process's console (level name, json), for a child process to configure the
    same: `configure_logging(level, json=json)`."""
    if not _SINKS:
        configure_logging()
    return logging.getLevelName(_SINKS[0].console_level).lower(), _SINKS[0].json


@contextmanager
def log_to_file(path: Path, *, decisions: bool = True) -> Iterator[None]:
    """While inside: every record at info and above also goes to `path` as JSON (appended;
    the records logged since the last file closed, or since `configure_logging`, first).
    `decisions`: whether a decision's sentence shows on a human console meanwhile (a
    job's `run.progress`: false is silence but for warnings)."""
    if not _SINKS:
        configure_logging()
    _SINKS[0].attach(Path(path), decisions)
    try:
        yield
    finally:
        _SINKS[0].detach()


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    """A lazy logger: module-level loggers follow a `configure_logging` made later."""
    return structlog.get_logger(**bound)
