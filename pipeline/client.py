"""Every Thrift call the pipeline makes goes through this module: server lists, connections, retries.

Two kinds of call, on purpose:
- `Connection.call` makes one attempt. A lost connection raises `ServerUnreachable` and ends the
  connection's `epoch`: the server may have restarted, so read ids obtained before then are never
  confirmed or aborted through a later connection (after a restart the same ids can name other
  clients' reads).
- `Connection.call_with_retries` retries connection-level errors (refused, reset, EOF, timeouts,
  thriftpy2's TTransportException) with exponential back-off; only for calls that are safe to
  repeat (put: at-least-once; peek). A server that is shutting down refuses calls with "queue ...
  is closed"; that counts as connection-level too.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from thriftpy2.rpc import make_client
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TFramedTransportFactory, TTransportException

from contract import kestrel_thrift

log = structlog.get_logger("kestrel.pipeline")

DEFAULT_PORT = 2229
# What a lost, refused or timed-out connection raises, from the socket up through thriftpy2.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError, OSError, EOFError, socket.timeout, TTransportException)


class ServerUnreachable(ConnectionError):
    """Raised when a server cannot be reached or the connection to it was lost."""


@dataclass(frozen=True)
class Server:
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_servers(text: str | None) -> list[Server]:
    """`host:2229,host2:2229` → servers; the port defaults to 2229. Any bad entry is refused."""
    if not text or not text.strip():
        raise ValueError("option 'servers' is required, e.g. .option('servers', 'host:2229,host2:2229')")
    out: list[Server] = []
    for position, part in enumerate(text.split(","), 1):
        entry = part.strip()
        if not entry:
            raise ValueError(f"option 'servers' has an empty entry at position {position} in {text!r} "
                             f"(a stray comma?)")
        host, sep, port = entry.rpartition(":")
        if not sep:
            host, port = entry, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"option 'servers': bad entry {entry!r}, expected host:port")
        server = Server(host, int(port))
        if server in out:
            raise ValueError(f"option 'servers' lists {server.address} twice")
        out.append(server)
    return out


class Connection:
    """One server's Thrift connection, opened on first use."""

    def __init__(self, server: Server, timeout_ms: int = 30_000) -> None:
        self.server = server
        self.timeout_ms = timeout_ms
        self._client: Any = None
        self.epoch: str | None = None  # names the current connection; None while there is none

    @property
    def address(self) -> str:
        return self.server.address

    def call(self, method: str, *args: Any) -> Any:
        """One attempt; a connection-level failure raises ServerUnreachable and starts a new epoch."""
        try:
            return getattr(self._connect(), method)(*args)
        except CONNECTION_ERRORS as e:
            self.close()
            reason = str(e) or type(e).__name__
            raise ServerUnreachable(f"kestrel {self.address}: {method} failed: {reason}") from e
        except TApplicationException as e:
            if not str(e.message or "").endswith(" is closed"):
                raise
            self.close()  # the server is shutting down: it refused the call, so it may be repeated
            raise ServerUnreachable(f"kestrel {self.address}: {method} refused while the server stops: "
                                    f"{e.message}") from e

    def _connect(self) -> Any:
        if self._client is None:
            self._client = make_client(kestrel_thrift.Kestrel, self.server.host, self.server.port,
                                       trans_factory=TFramedTransportFactory(), timeout=self.timeout_ms)
            self.epoch = uuid.uuid4().hex
        return self._client

    def open_epoch(self) -> str:
        """Connect if need be and name the connection: ids read after this moment may be closed
        through it for as long as `epoch` stays the same."""
        try:
            self._connect()
        except CONNECTION_ERRORS as e:
            self.close()
            raise ServerUnreachable(f"kestrel {self.address}: cannot connect: {e or type(e).__name__}") from e
        assert self.epoch is not None
        return self.epoch

    def call_with_retries(self, method: str, *args: Any, retries: int, backoff_ms: int,
                          max_backoff_ms: int = 10_000) -> Any:
        """`call`, retried after connection-level errors, waiting backoff_ms, then twice as long..."""
        delay = backoff_ms / 1000.0
        for attempt in range(retries + 1):
            try:
                return self.call(method, *args)
            except ServerUnreachable as e:
                if attempt == retries:
                    raise ServerUnreachable(f"{e} (gave up after {retries + 1} attempts)") from e
                log.warning("kestrel call failed; retrying", server=self.address, call=method,
                            attempt=attempt + 1, wait_s=delay, error=str(e))
                time.sleep(delay)
                delay = min(delay * 2, max_backoff_ms / 1000.0)
        raise AssertionError("unreachable")

    # -- the calls the pipeline makes, by name ---------------------------------------------

    def put(self, queue: str, items: list[bytes], *, retries: int, backoff_ms: int) -> int:
        return int(self.call_with_retries("put", queue, items, 0, retries=retries, backoff_ms=backoff_ms))

    def available(self, queue: str) -> int:
        """Items waiting in the queue (open reads not counted)."""
        return int(self.call("peek", queue).items)

    def open_reads(self, queue: str, max_items: int, auto_abort_ms: int) -> list[tuple[int, bytes]]:
        """Up to max_items as open reads: (read id, data), without waiting."""
        return [(item.id, item.data) for item in self.call("get", queue, max_items, 0, auto_abort_ms)]

    def confirm(self, queue: str, ids: Iterable[int]) -> int:
        return int(self.call("confirm", queue, set(ids)))

    def abort(self, queue: str, ids: Iterable[int]) -> int:
        return int(self.call("abort", queue, set(ids)))

    def close(self) -> None:
        self.epoch = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
