"""Logging: structlog, bound with role and node id; JSON when stderr is not a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever sys.stderr is now, so a replaced (or captured, then closed)
    stream never leaves loggers writing to a dead file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog once per process.

    `json=None` picks JSON lines when stderr is not a terminal (deployments, node
    processes whose stderr goes to a file) and a console renderer otherwise.
    """
    level_name = (level or os.environ.get("RLHF_ASYNC_LOG_LEVEL", "info")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]  # a TextIO by duck typing
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> structlog.stdlib.BoundLogger:
    """A lazy logger: module-level loggers follow a `configure_logging` made later."""
    return structlog.get_logger(**bound)
