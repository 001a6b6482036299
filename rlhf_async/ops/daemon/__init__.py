"""The long-running daemon: `rlhf-async serve` and its clients (submit, jobs, logs, cancel).

    Daemon(state_dir, max_jobs=1).serve()         # async; runs until SIGTERM
    call_daemon(state_dir, {"op": "submit", ...}) # from another process
"""

from rlhf_async.ops.daemon.client import call_daemon
from rlhf_async.ops.daemon.server import Daemon, DaemonError, StatePaths
from rlhf_async.ops.daemon.store import Job, JobStore

__all__ = ["Daemon", "DaemonError", "Job", "JobStore", "StatePaths", "call_daemon"]
