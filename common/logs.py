"""Structured logging: one JSON object per line (journald-friendly), via structlog."""

from __future__ import annotations

import logging
import sys
from typing import IO, Any, Protocol, TextIO, cast

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", stream: IO[str] | None = None) -> None:
    """Send structured JSON log lines at ``level`` or above to ``stream`` (stdout by default)."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, stream) if stream is not None else sys.stdout),
        cache_logger_on_first_use=False,
    )


class Logger(Protocol):
    """What FedFit's code may call on a logger: an event name and keyword fields, never a format string.

    structlog's bound loggers satisfy it; typing against it lets mypy check every log call."""

    def debug(self, event: str, **fields: Any) -> None: ...

    def info(self, event: str, **fields: Any) -> None: ...

    def warning(self, event: str, **fields: Any) -> None: ...

    def error(self, event: str, **fields: Any) -> None: ...

    def exception(self, event: str, **fields: Any) -> None: ...

    def bind(self, **fields: Any) -> Logger: ...


def get_logger(component: str, **context: Any) -> Logger:
    """A logger bound to a component name and extra context (agent id, federation, ...)."""
    return cast(Logger, structlog.get_logger().bind(component=component, **context))
