"""Socket reads and writes with the fewest system calls and no fresh buffer per read."""

from __future__ import annotations

from gevent.socket import socket as gsocket


def recv_append(sock: gsocket, scratch: memoryview, buf: bytearray) -> int:
    """Receive into `scratch` (a buffer kept by the connection) and append it to `buf`: a `recv`
    of a fresh bytes object would allocate the full chunk size each time. How many bytes came
    (0: the client closed)."""
    n: int = sock.recv_into(scratch)
    buf += scratch[:n]
    return n


def send_all(sock: gsocket, data: bytes) -> None:
    """Send all of `data`, in one `send` system call when the socket takes it all (gevent's own
    `sendall` first asks the kernel for the send buffer's size, a second system call per reply)."""
    sent: int = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])
