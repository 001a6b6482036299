"""Job store: the daemon's job table in SQLite (stdlib sqlite3, WAL), so a restart loses
no job.

States: queued -> running -> finished | failed | cancelled. A job the daemon stopped
(SIGTERM) or lost (daemon killed) goes back to queued; when it starts again it resumes
from its newest good checkpoint.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATES = ("queued", "running", "finished", "failed", "cancelled")
DONE_STATES = ("finished", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    state TEXT NOT NULL,
    config_name TEXT NOT NULL,   -- the file the user submitted ('' for the built-in config)
    config_text TEXT NOT NULL,   -- its TOML, frozen at submit time
    overrides TEXT NOT NULL,     -- JSON list of key=value
    run_dir TEXT NOT NULL,
    log_path TEXT NOT NULL,
    pid INTEGER,                 -- the job process (a session leader: pgid == pid)
    pid_started REAL,            -- its create time, so a reused pid is never signalled
    attempts INTEGER NOT NULL DEFAULT 0,
    resumed_from INTEGER,        -- checkpoint step the latest attempt resumed from
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    error TEXT NOT NULL DEFAULT '',
    submitted REAL NOT NULL,
    started REAL,
    finished REAL,
    cwd TEXT NOT NULL DEFAULT ''  -- the submitter's working directory: relative paths start there
)
"""


@dataclass(frozen=True)
class Job:
    id: int
    state: str
    config_name: str
    config_text: str
    overrides: list[str]
    run_dir: str
    log_path: str
    pid: int | None
    pid_started: float | None
    attempts: int
    resumed_from: int | None
    cancel_requested: bool
    exit_code: int | None
    error: str
    submitted: float
    started: float | None
    finished: float | None
    cwd: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class JobStore:
    """One connection, used from the daemon's event-loop thread (and read-only from the
    metrics thread through its own connection)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a job state change survives power loss
        self.db.execute(_SCHEMA)
        if "cwd" not in {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}:
            # a store made before jobs carried their submitter's directory
            self.db.execute("ALTER TABLE jobs ADD COLUMN cwd TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        self.db.close()

    def add(self, config_name: str, config_text: str, overrides: list[str],
            runs_dir: Path, logs_dir: Path, cwd: str = "") -> Job:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO jobs (state, config_name, config_text, overrides, run_dir, "
                "log_path, submitted, cwd) VALUES ('queued', ?, ?, ?, '', '', ?, ?)",
                (config_name, config_text, json.dumps(overrides), time.time(), cwd))
            job_id = int(cur.lastrowid or 0)
            self.db.execute("UPDATE jobs SET run_dir = ?, log_path = ? WHERE id = ?",
                            (str(runs_dir / f"job-{job_id}"),
                             str(logs_dir / f"job-{job_id}.log"), job_id))
        return self.get(job_id)

    def get(self, job_id: int) -> Job:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return _job(row)

    def list(self, states: tuple[str, ...] = STATES) -> list[Job]:
        marks = ",".join("?" * len(states))
        rows = self.db.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id",
                               states).fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[str, int]:
        rows = self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {s: 0 for s in STATES} | {r[0]: int(r[1]) for r in rows}

    def update(self, job_id: int, **fields: Any) -> None:
        unknown = set(fields) - set(Job.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown job fields {sorted(unknown)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.db:
            self.db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))


def _job(row: sqlite3.Row) -> Job:
    d = dict(row)
    d["overrides"] = json.loads(d["overrides"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return Job(**d)
