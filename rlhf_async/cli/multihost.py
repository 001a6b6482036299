"""Run a job across hosts (each running `rlhf-async agent`); this host runs the coordinator.

    python -m rlhf_async.cli.multihost --hosts HOSTS --keys KEYS --address 10.0.0.1 \\
        [CONFIG] [key=value ...]

ADDRESS must be this host's address as the others reach it; nodes go wherever the hosts
file puts their devices (see rlhf_async/job/multihost.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhf_async.config import ConfigError, load_config
from rlhf_async.job.lock import RunLockError
from rlhf_async.job.multihost import run_multihost
from rlhf_async.log import configure_logging
from rlhf_async.runtime.hosts import HostsError, load_hosts
from rlhf_async.strategies.separation.startup import PipelineError
from rlhf_async.wire.security import SecurityError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_async.cli.multihost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=Path, required=True)
    p.add_argument("--keys", type=Path, required=True)
    p.add_argument("--address", required=True, help="this host's address, as others reach it")
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    configure_logging("warning")
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    try:
        summary = run_multihost(load_config(config, overrides), load_hosts(args.hosts),
                                args.keys, args.address)
    except (ConfigError, HostsError, SecurityError, PipelineError, RunLockError) as e:
        print(f"multihost: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main())
