"""Arguments several commands share: `CMD [CONFIG] [key=value ...]`."""

from __future__ import annotations

import argparse


def split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(config file, overrides): `CMD key=value ...` without a config file works too."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    return config, overrides
