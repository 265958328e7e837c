"""A small Kestrel Thrift client for Spark tasks: a server list, retries with back-off."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
from thriftpy2.rpc import make_client
from thriftpy2.transport import TFramedTransportFactory

from contract import kestrel_thrift

log = structlog.get_logger("kestrel.pipeline")

T = TypeVar("T")


def parse_servers(text: str | None) -> list[tuple[str, int]]:
    """`host:2229,host2:2229` → [(host, 2229), ...]; the port defaults to 2229."""
    if not text:
        raise ValueError("option 'servers' is required, e.g. .option('servers', 'host:2229,host2:2229')")
    out = []
    for part in text.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host:
            host, port = port, "2229"
        if not port.isdigit():
            raise ValueError(f"bad server {part!r}: expected host:port")
        out.append((host, int(port)))
    return out


class KestrelClient:
    """One server's Thrift connection, reopened and retried with back-off when it is lost."""

    def __init__(self, host: str, port: int, retries: int = 3, backoff: float = 0.2,
                 timeout_ms: int = 30_000) -> None:
        self.host, self.port = host, port
        self.retries, self.backoff, self.timeout_ms = retries, backoff, timeout_ms
        self._client: Any = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> Any:
        if self._client is None:
            self._client = make_client(kestrel_thrift.Kestrel, self.host, self.port,
                                       trans_factory=TFramedTransportFactory(), timeout=self.timeout_ms)
        return self._client

    def call(self, method: str, *args: Any) -> Any:
        """Call `method`, reconnecting on a lost connection; raises once the retries are spent."""
        return self._retry(lambda c: getattr(c, method)(*args), method)

    def _retry(self, call: Callable[[Any], T], what: str) -> T:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return call(self._connect())
            except (ConnectionError, OSError, EOFError) as e:
                self.close()
                if attempt == self.retries:
                    raise ConnectionError(f"kestrel {self.address}: {what} failed after "
                                          f"{self.retries + 1} attempts: {e}") from e
                log.warning("kestrel call failed; retrying", server=self.address, call=what, error=str(e))
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
