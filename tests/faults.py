"""Running a job while a fault is injected on a thread, and the exactly-once record it
leaves (for the chaos and Ray fault tests)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rlhf_async import job
from rlhf_async.config import JobConfig


def run_during(cfg: JobConfig, fault: Callable[[threading.Event], None]) -> dict:
    """job.run(cfg) while `fault(stop)` runs on a thread; `stop` is set when the job ends
    and the fault's thread is joined before this returns (or raises)."""
    stop = threading.Event()
    thread = threading.Thread(target=fault, args=(stop,))
    thread.start()
    try:
        return job.run(cfg)
    finally:
        stop.set()
        thread.join()


def trained_counts(run_dir: Path) -> Counter[int]:
    """How many times each sample id was trained, from RUN_DIR/trained_samples.jsonl."""
    lines = (run_dir / "trained_samples.jsonl").read_text().splitlines()
    return Counter(s for line in lines for s in json.loads(line)["sample_ids"])


def steps_done(run_dir: Path) -> int:
    """Steps trained so far (records in RUN_DIR/metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_steps(run_dir: Path, n: int, stop: threading.Event) -> bool:
    """Until `n` steps are trained (True) or the job ended (False)."""
    while steps_done(run_dir) < n:
        if stop.wait(0.05):
            return False
    return True


def stop_job(run_dir: Path) -> None:
    """`rlhf-async stop` of the Separation job in `run_dir`: its trainer finishes the step
    in flight and checkpoints; `job.run` returns the stopped summary."""
    from rlhf_async.control.client import call_coordinator, read_coordinator_file
    from rlhf_async.runtime import run_loop

    info = read_coordinator_file(run_dir)
    run_loop(call_coordinator(info["control"], "stop", timeout=10, keys=info.get("keys")))
