"""The accept loop every listener shares: a bounded pool of connections, a calm response to running out
of file descriptors, and a shutdown that answers what is in flight and closes what is idle.

Out of descriptors (EMFILE, ENFILE), `accept` fails until some connection closes. The loop then backs
off (10 ms doubling to half a second), logs one warning per interval with the number of refused
attempts, and picks up the clients waiting in the backlog as soon as descriptors return.

A client whose machine vanished (power cut, a dropped route) sends no FIN: without TCP keepalive its
connection, its waits and its open memcache reads would stay until `client_timeout`, which is
unlimited by default. So every accepted connection is probed once idle for `tcp_keepalive`: the
options are set on the listening socket, from which each accepted connection takes them (Linux), rather
than four system calls a connection.

Each connection is accepted from the OS listening socket itself, with no gevent socket between: gevent's
accept makes a socket object of its own for each connection (four system calls: `getsockname`, an
`ioctl` and two `fcntl`) only for it to be handed over. Here the loop calls `accept` until it would
block, then waits on one watcher of the listening socket, made once.

A connection is served on a greenlet kept from one that ended (up to `SPARE_WORKERS` are kept): a new
greenlet costs about 12 µs to spawn and end, a map and an unmap of its 16 KB frame stack among them,
against 1 µs to hand a kept one the next connection. Each connection still starts in a context of its
own (the context variables of the last one are not seen), in the pool while it is served.
"""

from __future__ import annotations

import contextvars
import errno
import ipaddress
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import gevent
import structlog
from gevent import get_hub, getcurrent
from gevent.pool import Pool
from gevent.socket import socket as gsocket

from kestrel.service import LISTEN_BACKLOG
from kestrel.service.memory_return import MEMORY_RETURN
from kestrel.service.socket_io import OSSocket, Readable, close_lingering, end_reading
from kestrel.service.turns import step_aside

log = structlog.get_logger("kestrel.listener")

# Serves one connection; True when its client ended the stream and all it sent was read, so that
# the socket closes at once (nothing unread, nothing more to come: no lingering close needed).
Handler = Callable[[Any, tuple[str, int]], bool | None]

# accept() fails with these while the process or the system has no descriptor (or buffer) to spare.
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept() fails with these when a client gave up before we took it: try the next one.
CLIENT_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})

MIN_BACKOFF = 0.01  # seconds
MAX_BACKOFF = 0.5
WARN_INTERVAL = 10.0  # seconds between two warnings while descriptors stay exhausted


KEEPALIVE_PROBES = 3
ACCEPT_BURST = 64  # accepts in a row before the accept loop lets the connections run
# Greenlets kept, once their connection ended, for the next ones: as many as the accept loop takes in
# a row, so that a burst of clients that connect and close (each burst taken in one go) makes none.
SPARE_WORKERS = ACCEPT_BURST

def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve beyond loopback
        return False


def peer_text(address: tuple[str, int]) -> str:
    """A client's address as every log line of every port writes it, `host:port` (not the tuple)."""
    return f"{address[0]}:{address[1]}"


# The OS socket's own accept: the new connection's descriptor and address, no socket object made (the
# typed `accept` makes one, of the class monkey patching put in the `socket` module: gevent's).
_accept: Callable[[socket.socket], tuple[int, Any]] = OSSocket._accept  # type: ignore[attr-defined]


def set_keepalive(sock: socket.socket | gsocket, idle_ms: int) -> None:
    """Probe the peer after `idle_ms` of silence, then every third of that; after KEEPALIVE_PROBES
    unanswered probes the kernel resets the connection, so a vanished client is noticed within
    twice `idle_ms` and its session closed (its open reads go back to their queues)."""
    idle = max(1, idle_ms // 1000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timing applies
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // KEEPALIVE_PROBES))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


class Listener:
    """Accepts clients on one port and runs `handle(sock, address)` for each in a bounded pool. `sock`
    is the connection's OS socket (src/kestrel/service/socket_io.py), or with `cooperative` gevent's socket,
    for a handler written for blocking sockets (the admin port's WSGI server)."""

    def __init__(self, name: str, address: tuple[str, int], handle: Handler, max_connections: int,
                 keepalive_ms: int | None = None, warn_interval: float = WARN_INTERVAL,
                 cooperative: bool = False, make_room: Callable[[], None] | None = None) -> None:
        self.name = name
        self.cooperative = cooperative
        self.make_room = make_room  # called when the pool is full and a client waits to connect
        self.handle = handle
        self.pool = Pool(max_connections)
        self.warn_interval = warn_interval
        self.socket = OSSocket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setblocking(False)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Every reply goes out as it is written, as Kestrel's and Redis's do: with Nagle's algorithm a
        # reply sent just after another (a get's item behind the put's STORED, once its read-back
        # came) waited for the client's delayed ACK, 40 ms. Inherited by every connection accepted.
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if keepalive_ms is not None:
            set_keepalive(self.socket, keepalive_ms)  # inherited by every connection it accepts
        self.socket.bind(address)
        self.socket.listen(LISTEN_BACKLOG)
        self.address: tuple[str, int] = self.socket.getsockname()[:2]
        self.connections: set[socket.socket | gsocket] = set()
        self._acceptor: gevent.Greenlet | None = None
        self._spare: list[gevent.Greenlet] = []  # workers waiting for a connection, out of the pool
        self._refused = 0  # accepts refused for want of descriptors since the last warning
        self._refused_total = 0
        self._exhausted_since = 0.0
        self._last_warning: float | None = None

    def start(self) -> None:
        self._acceptor = gevent.spawn(self._accept_loop)

    # -----------------------------------------------------------------------------------------
    # Accepting

    def _accept_loop(self) -> None:
        listening = self.socket
        readable = Readable(listening.fileno())
        try:
            self._accept_from(listening, readable)
        finally:
            readable.close()

    def _accept_from(self, listening: socket.socket, readable: Readable) -> None:
        family, kind, proto = listening.family, listening.type, listening.proto
        backoff = MIN_BACKOFF
        accepted_count = 0
        while True:
            if self.make_room is not None and self.pool.full():
                readable.wait()  # a client waits in the backlog
                if self.pool.full():
                    self.make_room()
            self.pool.wait_available()
            try:
                fd, address = _accept(listening)
            except BlockingIOError:
                readable.wait()  # until a client connects
                continue
            except OSError as e:
                if listening.fileno() < 0:
                    return  # closed by stop_accepting
                if e.errno in CLIENT_GONE:
                    continue
                if e.errno in OUT_OF_DESCRIPTORS:
                    self._note_refused(e)
                else:
                    log.error("accept failed; retrying", listener=self.name, error=repr(e))
                gevent.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            sock: socket.socket | gsocket
            if self.cooperative:
                sock = gsocket(family, kind, proto, fd)
            else:
                sock = OSSocket(family, kind, proto, fd)  # told its kind: no system call to ask
                sock.setblocking(False)  # Linux's accept does not pass it on from the listening socket
            backoff = MIN_BACKOFF
            if self._refused_total:
                self._note_recovered()
            self.connections.add(sock)
            MEMORY_RETURN.opened()
            if self._spare:
                worker = self._spare.pop()
                self.pool.add(worker)
                get_hub().loop.run_callback(worker.switch, (sock, address))
            else:
                self.pool.spawn(partial(self._work, sock, address))
            accepted_count += 1
            if accepted_count % ACCEPT_BURST == 0:
                step_aside()  # thousands connecting at once: the connections already here go on

    def _note_refused(self, error: OSError) -> None:
        now = time.monotonic()
        if not self._refused_total:
            self._exhausted_since = now
        self._refused += 1
        self._refused_total += 1
        if self._last_warning is None or now - self._last_warning >= self.warn_interval:
            log.warning("out of file descriptors: new clients wait in the backlog", listener=self.name,
                        error=errno.errorcode.get(error.errno or 0, str(error.errno)),
                        refused=self._refused, open_connections=len(self.connections))
            self._last_warning = now
            self._refused = 0

    def _note_recovered(self) -> None:
        log.warning("accepting clients again", listener=self.name, refused=self._refused_total,
                    seconds_without_descriptors=round(time.monotonic() - self._exhausted_since, 3))
        self._refused = self._refused_total = 0
        self._last_warning = None

    def _work(self, sock: socket.socket | gsocket, address: tuple[str, int]) -> None:
        """Serve connections, each in a new context, the next one while kept in `_spare`. A kill ends
        the worker whether it is serving or waiting."""
        worker = getcurrent()
        hub = get_hub()
        while True:
            contextvars.Context().run(self._serve, sock, address)
            if self._acceptor is None or len(self._spare) >= SPARE_WORKERS:
                return
            self.pool.discard(worker)
            self._spare.append(worker)
            sock, address = hub.switch()

    def _serve(self, sock: socket.socket | gsocket, address: tuple[str, int]) -> None:
        ended = False
        try:
            ended = self.handle(sock, address) is True
        except OSError:
            pass  # the client went away; the handler has closed its session
        except Exception:
            log.exception("connection handler failed", listener=self.name,
                          client=peer_text(address))
        finally:
            self.connections.discard(sock)
            if ended:
                sock.close()
            else:
                close_lingering(sock)  # the replies sent last reach the client, whatever it sent after
            MEMORY_RETURN.closed()  # after a wave of closes, their memory goes back to the system

    # -----------------------------------------------------------------------------------------
    # Stopping, in the order a clean shutdown needs

    def stop_accepting(self) -> None:
        """Close the listening socket at once; clients still in the backlog are refused."""
        if self._acceptor is not None:
            self._acceptor.kill(block=False)
            self._acceptor = None
        for worker in self._spare:
            worker.kill(block=False)
        self._spare.clear()
        self.socket.close()

    def end_reading(self) -> None:
        """Each connection reads end-of-stream once its buffered requests are answered, so idle ones
        close at once and busy ones close after replying."""
        for sock in list(self.connections):
            end_reading(sock)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every connection to finish; True if they all did."""
        return bool(self.pool.join(timeout=timeout))

    def kill(self) -> None:
        """End the connections that outlived the shutdown timeout (a client that stopped reading)."""
        self.pool.kill(block=True, timeout=1.0)
