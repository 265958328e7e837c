"""The pipeline's side of talking to servers; every Thrift call itself goes through the `client` package.

What is the pipeline's own:
- `parse_servers`: the `servers` option, checked strictly before anything is done (a stray comma, a
  bad port or a server listed twice fails the job, naming the option).
- `with_retries`: the documented back-off on top of the client. The client repeats a call once on a
  new connection when a pooled one turns out dead; on top of that, a server that is unreachable or
  shutting down (the client's ServerUnavailable, ServerClosing included) is retried `retries` times,
  waiting `backoff_ms`, then twice as long, up to 10 s.
- `take_open_reads`: a server caps the open reads of one connection on one queue
  (`max_open_reads`), and Thrift open reads outlive their connection, so each `get` of a fetch goes
  over a connection of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from kestrel.client import KestrelClientError, NoServers, Server, ServerUnavailable, parse_address

log = structlog.get_logger("kestrel.pipeline")

T = TypeVar("T")


class ServersUnreachable(ConnectionError):
    """Raised when a call still failed at the connection level after every retry."""


def parse_servers(text: str | None) -> list[str]:
    """`host:2229,host2:2229` → `["host:2229", "host2:2229"]`; the port defaults to 2229."""
    if not text or not text.strip():
        raise ValueError("option 'servers' is required, e.g. .option('servers', 'host:2229,host2:2229')")
    out: list[str] = []
    for position, part in enumerate(text.split(","), 1):
        entry = part.strip()
        if not entry:
            raise ValueError(f"option 'servers' has an empty entry at position {position} in {text!r} "
                             f"(a stray comma?)")
        try:
            host, port = parse_address(entry)
        except ValueError:
            raise ValueError(f"option 'servers': bad entry {entry!r}, expected host:port") from None
        address = f"{host}:{port}"
        if address in out:
            raise ValueError(f"option 'servers' lists {address} twice")
        out.append(address)
    return out


def fresh_connections(address: str) -> Server:
    """A Server that opens a new connection for every call (it keeps none idle)."""
    host, port = parse_address(address)
    return Server(host, port, max_idle=0)


def retryable(error: BaseException) -> bool:
    """A server unreachable or shutting down (on every server tried, for a NoServers)."""
    if isinstance(error, ServerUnavailable):
        return True
    if isinstance(error, NoServers):
        return any(retryable(e) for e in error.errors)
    return False


def with_retries(call: Callable[[], T], what: str, *, retries: int, backoff_ms: int,
                 max_backoff_ms: int = 10_000) -> T:
    """`call()`, retried after connection-level failures, waiting backoff_ms, then twice as long..."""
    delay = backoff_ms / 1000.0
    for attempt in range(retries + 1):
        try:
            return call()
        except KestrelClientError as e:
            if not retryable(e):
                raise
            if attempt == retries:
                raise ServersUnreachable(f"{what}: {e} (gave up after {retries + 1} attempts)") from e
            log.warning("kestrel call failed; retrying", call=what, attempt=attempt + 1, wait_s=delay,
                        error=str(e))
            time.sleep(delay)
            delay = min(delay * 2, max_backoff_ms / 1000.0)
    raise AssertionError("unreachable")


@dataclass
class TakenReads:
    """Items taken as open reads from one server, and why the fetch ended early (None: it did not)."""

    ids: list[int] = field(default_factory=list)
    items: list[bytes] = field(default_factory=list)
    failure: KestrelClientError | None = None


def take_open_reads(address: str, queue: str, quota: int, auto_abort_ms: int) -> TakenReads:
    """Up to `quota` items as open reads, without waiting, each `get` over a new connection, until
    the quota is met or the queue is empty. A server that fails or refuses ends the fetch early
    with what was taken so far; the caller decides what that failure means."""
    server = fresh_connections(address)
    taken = TakenReads()
    while len(taken.ids) < quota:
        try:
            got = server.get(queue, quota - len(taken.ids), 0, auto_abort_ms)
        except KestrelClientError as e:
            log.warning("fetch ended early", server=address, error=str(e))
            taken.failure = e
            break
        if not got:
            break
        taken.ids.extend(item.id for item in got)
        taken.items.extend(item.data for item in got)
    return taken
