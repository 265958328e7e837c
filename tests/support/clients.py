"""Thrift clients of the contract for the tests, over the transports and protocols Kestrel serves."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from thriftpy2.protocol import TCompactProtocolFactory
from thriftpy2.rpc import make_client
from thriftpy2.transport import TBufferedTransportFactory, TFramedTransportFactory

from kestrel.contract import kestrel_thrift as kestrel


def thrift_client(port: int, *, protocol: str = "binary", transport: str = "framed", timeout_ms: int = 10_000,
                  host: str = "127.0.0.1") -> Any:
    """A thriftpy2 client of the Kestrel service on `host:port`; the caller closes it. The time-out is a
    deadline for a loaded machine, not a budget."""
    kwargs: dict[str, Any] = {
        "trans_factory": TFramedTransportFactory() if transport == "framed" else TBufferedTransportFactory()}
    if protocol == "compact":
        kwargs["proto_factory"] = TCompactProtocolFactory()
    return make_client(kestrel.Kestrel, host, port, timeout=timeout_ms, **kwargs)


@contextmanager
def thrift(srv: Any, protocol: str = "binary", transport: str = "framed", **options: Any) -> Iterator[Any]:
    """`thrift_client` on a test server's Thrift port, closed on leaving."""
    c = thrift_client(srv.thrift_port, protocol=protocol, transport=transport, **options)
    try:
        yield c
    finally:
        c.close()


def every_item(c: Any, queue: str) -> list[bytes]:
    """Every item of `queue` through Thrift client `c`, by gets until one comes back empty: one get
    stops once its items reach a get's bytes (512 KB), however many it asks for."""
    taken: list[bytes] = []
    while got := c.get(queue, 10_000, 0, 0):
        taken.extend(item.data for item in got)
    return taken


def consume_until_stopped(c: Any, queue: str, max_items: int, stop: threading.Event, confirmed: list[bytes],
                          unanswered: list[bytes]) -> None:
    """Take up to `max_items` at a time from `queue` as open reads (30 s auto-abort) through Thrift
    client `c`, and confirm each batch, until `stop` is set or the server goes. A batch whose confirm
    was answered in full goes to `confirmed`; one whose confirm went unanswered (the server died
    meanwhile: done or not, no one knows) to `unanswered`; what a get in flight took comes back to
    the queue at the restart, its reads open."""
    while not stop.is_set():
        try:
            got = c.get(queue, max_items, 100, 30_000)
        except Exception:
            return
        try:
            if got and c.confirm(queue, {i.id for i in got}) == len(got):
                confirmed.extend(i.data for i in got)
        except Exception:
            unanswered.extend(i.data for i in got)
            return
