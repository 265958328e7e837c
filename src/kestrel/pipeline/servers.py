"""The pipeline's side of talking to servers; every Thrift call itself goes through the `client` package.

What is the pipeline's own:
- `parse_servers`: the `servers` option, checked strictly before anything is done (a stray comma, a
  bad port or a server listed twice fails the job, naming the option).
- `Reachability`: which servers a stream could not reach, since when; it spaces out the attempts
  on a server that is down, logs once per interval rather than once per attempt, and fails the
  stream once no server has answered for the stream's `unreachableTimeoutMs`.
- `take_open_reads`: a fetch's open reads, taken with `get_timed`, which a server does not cap per
  connection (Kestrel's `get` stops at `max_open_reads`): a fetch is one call, up to the server's
  `max_batch_items`. Each further call goes over a new connection, so that a server which still
  caps it (an older version of this one) hands out the rest there.

Every call's time-out is the stream's `timeoutMs` (or the client's default for a batch read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import structlog

from kestrel.client import KestrelClientError, Server, parse_address

log = structlog.get_logger("kestrel.pipeline")


class ServersUnreachable(ConnectionError):
    """Raised when servers a read needs could not be reached (retries are the client's own)."""


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


def connect(address: str, timeout_ms: int = 10_000, max_idle: int = 8) -> Server:
    """A client of one server of the `servers` option (connections opened as calls need them), each
    call failing after `timeout_ms` without an answer (connecting: at most 2 s of it)."""
    host, port = parse_address(address)
    return Server(host, port, timeout_ms=timeout_ms, connect_timeout_ms=min(timeout_ms, 2000),
                  max_idle=max_idle)


RETRY_S = 1.0  # a server that failed a call is asked again no sooner (a stream plans every few ms)
LOG_EVERY_S = 30.0  # a server still down is reported again no sooner


@dataclass
class _Down:
    since: float  # monotonic time of the first failure in this outage
    retry_at: float  # no call before this
    logged_at: float  # the last warning
    attempts: int  # failed calls in this outage
    error: str  # the latest


class Reachability:
    """The servers of one stream that stopped answering, and since when.

    `due(server)` says whether to call a server now: one that failed is asked again only after
    `RETRY_S`. `failed` logs the first failure of an outage, then at most one warning each
    `LOG_EVERY_S` with the attempts since; `answered` logs the end of an outage. `check` raises
    ServersUnreachable once every server has been down for `fail_after_s` (0: never)."""

    def __init__(self, servers: list[str], fail_after_s: float, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.servers, self.fail_after_s, self.what, self.clock = servers, fail_after_s, what, clock
        self.down: dict[str, _Down] = {}
        self.lock = threading.Lock()  # planning and the stream's keeper both report

    def due(self, server: str) -> bool:
        down = self.down.get(server)
        return down is None or self.clock() >= down.retry_at

    def is_down(self, server: str) -> bool:
        return server in self.down

    def failed(self, server: str, call: str, error: BaseException, started: float | None = None) -> None:
        """`call` to `server` failed; `started` (monotonic) is when it was sent, where the outage
        began at the latest (a call that times out is reported only when its time is up)."""
        with self.lock:
            now = self.clock()
            down = self.down.get(server)
            if down is None:
                since = now if started is None else started
                self.down[server] = _Down(since, now + RETRY_S, now, 1, str(error))
                log.warning("server unreachable; going on without it, asking again every second",
                            server=server, call=call, error=str(error))
                return
            down.retry_at, down.attempts, down.error = now + RETRY_S, down.attempts + 1, str(error)
            if now - down.logged_at >= LOG_EVERY_S:
                down.logged_at = now
                log.warning("server still unreachable", server=server, call=call,
                            down_s=round(now - down.since), attempts=down.attempts, error=str(error))

    def answered(self, server: str) -> None:
        with self.lock:
            down = self.down.pop(server, None)
            if down is not None:
                log.info("server reachable again", server=server,
                         down_s=round(self.clock() - down.since, 1), attempts=down.attempts)

    def check(self) -> None:
        """Raises ServersUnreachable when no server has answered for `fail_after_s`."""
        with self.lock:
            if not self.fail_after_s or len(self.down) < len(self.servers):
                return
            all_down_s = self.clock() - max(d.since for d in self.down.values())
            if all_down_s >= self.fail_after_s:
                errors = "; ".join(f"{s}: {self.down[s].error}" for s in self.servers)
                raise ServersUnreachable(
                    f"{self.what}: no server answered for {all_down_s:.0f} s (unreachableTimeoutMs is "
                    f"{self.fail_after_s * 1000:.0f}): {', '.join(self.servers)} ({errors})")

    def down_now(self) -> list[str]:
        with self.lock:
            return sorted(self.down)


_ID, _DATA, _ADDED, _EXPIRY = map(attrgetter, ("id", "data", "add_time_msec", "expiry_msec"))


@dataclass
class TakenReads:
    """Items taken as open reads from one server, and why the fetch ended early (None: it did not)."""

    ids: list[int] = field(default_factory=list)
    items: list[bytes] = field(default_factory=list)
    added: list[int] = field(default_factory=list)  # each item's add time, ms since the epoch
    expiry: list[int] = field(default_factory=list)  # each item's expiry, ms since the epoch; 0: never
    failure: KestrelClientError | None = None


def take_open_reads(address: str, queue: str, quota: int, auto_abort_ms: int, timeout_ms: int) -> TakenReads:
    """Up to `quota` items as open reads with their times, without waiting, each `get_timed` over a
    new connection (it creates no queue), until the quota is met or the queue is empty: one call
    and one connection for a quota within the server's `max_batch_items`. A server
    that fails or refuses ends the fetch early with what was taken so far; the caller decides what
    that failure means."""
    server = connect(address, timeout_ms, max_idle=0)
    taken = TakenReads()
    while len(taken.ids) < quota:
        try:
            got = server.get_timed(queue, quota - len(taken.ids), 0, auto_abort_ms)
        except KestrelClientError as e:
            log.warning("fetch ended early", server=address, error=str(e))
            taken.failure = e
            break
        if not got:
            break
        taken.ids.extend(map(_ID, got))
        extend_timed(taken.items, taken.added, taken.expiry, got)
    return taken


def extend_timed(items: list[bytes], added: list[int], expiry: list[int], timed: Any) -> None:
    """Append TimedItems' data, add times and expiries (0: never), each field in one compiled pass
    over the items rather than a Python loop."""
    items.extend(map(_DATA, timed))
    added.extend(map(_ADDED, timed))
    expiry.extend(expiry or 0 for expiry in map(_EXPIRY, timed))
