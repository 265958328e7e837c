"""Telling the service manager (systemd's `Type=notify`) when the server is ready and when it stops.

A replay of millions of items takes seconds, so a unit that counts the server started when its
process is (`Type=simple`) starts the units after it while no port answers yet. Under `Type=notify`
systemd sets `NOTIFY_SOCKET`, and the server sends `READY=1` once every listener is bound and
`STOPPING=1` as it begins to stop (systemd's `sd_notify` protocol: one datagram of `KEY=value`
lines to that Unix socket; a name starting with `@` is in the abstract namespace). Without the
variable nothing is sent.
"""

from __future__ import annotations

import os
import socket

import structlog

log = structlog.get_logger("kestrel.app")


def notify(*states: str) -> None:
    """Send `states` (e.g. `READY=1`) to the service manager, if one listens; a failure is logged,
    never raised: the server serves whether or not its manager hears."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(states).encode())
    except OSError as e:
        log.warning("cannot tell the service manager", notify_socket=os.environ["NOTIFY_SOCKET"],
                    states=list(states), error=str(e))
