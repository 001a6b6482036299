"""`rlhf-async` command line."""

from rlhf_async.cli.main import main

__all__ = ["main"]
