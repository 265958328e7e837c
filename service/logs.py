"""structlog set-up: readable lines on a terminal, JSON lines otherwise (files, journald).

Each connection runs in its own greenlet, which has its own context: `bind_client` there puts the
client's address on every line logged on its behalf, even by layers that know nothing of clients
(the queue collection logging a queue's creation).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def bind_client(peer: str) -> None:
    """Log the client's address with every event of the calling greenlet (its connection)."""
    structlog.contextvars.bind_contextvars(client=peer)
