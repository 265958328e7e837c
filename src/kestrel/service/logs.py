"""structlog set-up: JSON lines or readable console lines; by default (`auto`) readable lines on a
terminal, JSON lines otherwise (files, journald). One stream (stderr), one format: what libraries log
through the standard library's `logging` (kazoo) and Python's warnings come through the same
renderer, and gevent's report of an error no greenlet caught too.

Each connection runs in its own greenlet, which has its own context: `bind_client` there puts the
client's address on every line logged on its behalf, even by layers that know nothing of clients
(the queue collection logging a queue's creation).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from types import TracebackType
from typing import Any

import structlog
from gevent import monkey
from gevent.hub import Hub

log = structlog.get_logger("kestrel.server")


LOG_FORMATS = ("auto", "json", "console")


def configure_logging(level: str = "info", log_format: str = "auto") -> None:
    """Log at `level` and above to stderr, as `log_format`: json, console, or auto (console on a
    terminal, json otherwise)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    console = sys.stderr.isatty() if log_format == "auto" else log_format == "console"
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if console
        else structlog.processors.JSONRenderer())
    stream = sys.stderr
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *([_escape_controls] if console else []),  # (JSON escapes them itself)
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *_: _LineWriter(stream),
        cache_logger_on_first_use=True,
    )
    Hub.print_exception = _log_uncaught
    root = logging.getLogger()
    root.handlers[:] = [_ToStructlog()]
    root.setLevel(getattr(logging, level.upper()))
    logging.captureWarnings(True)


# An OS lock, whatever monkey patching made of `threading`: the pool's threads (a pack, a config load)
# log too, and a gevent lock taken from one of them hung it, and the greenlet waiting on it, for good.
_WRITE_LOCK = monkey.get_original("_thread", "allocate_lock")()
_OSRLock = monkey.get_original("_thread", "RLock")


class _LineWriter:
    """Writes each rendered line whole, under one OS lock. Its holder only prints and flushes a
    line, never yields: a greenlet that waits for it waits no longer than that write."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        with _WRITE_LOCK:
            print(message, file=self._file, flush=True)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


# Control characters as escapes: C0 (but for the line breaks and tabs of a traceback), DEL and C1.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_TRACEBACK_CONTROLS = {c: e for c, e in _CONTROLS.items() if chr(c) not in "\n\t"}


def _escape_controls(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A console line shows what a client sent (a method name, a queue name) with its control
    characters escaped: raw, an escape sequence would move the terminal's cursor or clear it, and a
    line break would forge a line."""
    for key, value in event.items():
        if isinstance(value, str) and not value.isprintable():
            event[key] = value.translate(_TRACEBACK_CONTROLS if key == "exception" else _CONTROLS)
    return event


class _ToStructlog(logging.Handler):
    """A standard-library log record as a line of the server's log, under its logger's name."""

    def createLock(self) -> None:
        self.lock = _OSRLock()  # taken by any thread that logs: an OS lock (see _LineWriter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = record.getMessage()
        except Exception:  # a library's bad format string must not lose the line
            event = str(record.msg)
        fields: dict[str, Any] = {"logger": record.name}
        if record.exc_info:
            fields["exc_info"] = record.exc_info
        structlog.get_logger(record.name).log(record.levelno, event, **fields)


def _log_uncaught(hub: Hub, context: Any, kind: type[BaseException] | None, value: BaseException | None,
                  tb: TracebackType | None) -> None:
    """gevent reports an error no greenlet caught as a bare traceback on stderr; every line the
    server writes is structured, so it goes to the log as one event instead."""
    log.error("uncaught error", context=repr(context)[:500], exc_info=(kind, value, tb))


def bind_client(peer: str) -> None:
    """Log the client's address with every event of the calling greenlet (its connection)."""
    structlog.contextvars.bind_contextvars(client=peer)
