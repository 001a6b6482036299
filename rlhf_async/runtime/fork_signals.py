"""Importing this module makes the process ignore SIGTERM: only the fork server imports it
(`launcher.PRELOAD`). multiprocessing's server already ignores SIGINT; a SIGTERM sent to
the run's process group (GNU timeout, the job daemon, `kill -- -PGID`) would otherwise end
it while the run is stopping gracefully, and with it the exit codes of the nodes and ranks
it forked (read back through it) and, by their parent-death signal, the nodes. The run's
process handles the stop; the server exits when the run's process does (its alive pipe
closes). What it forks restores SIGTERM (`launcher._forked_node`; a lock-step rank ignores
it, its parent tells it to stop)."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
