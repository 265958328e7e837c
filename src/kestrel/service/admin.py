"""The admin HTTP port: the page at / (src/kestrel/service/dashboard/), /ping, /ready, /stats.json,
/stats.txt and Prometheus /metrics.

`/ping` is liveness: `pong` while the process answers, whatever its status. `/ready` is readiness
for a load balancer in front of writers: 200 while the server is Up, 503 once it is ReadOnly or
Quiescent or shutting down; `/ready/read` the same for readers (200 while Up or ReadOnly). Both
follow a status change at once, as the ZooKeeper server sets do, ahead of its grace period.

Each request, from the wait for its first line to the last byte of its answer, has
`request_timeout`: a client that connects and sends nothing, trickles its request or reads its
answer that slowly is closed rather than holding one of the port's connections for good (the
probes, scrapes and the page's polls take milliseconds; a browser connects again for its next);
and when every connection is taken and another client is waiting to connect, the one that has
waited longest for a request is closed to make room for it, or else the one that has been longest
answering (a client reading its page that slowly). At most `PAGES_AT_ONCE` answers of the pages
that cost a pass over every queue (the stats and metrics, megabytes with thousands of queues) are
rendered or sent at once: the others wait their turn, so a crowd of slow readers holds that many
copies in memory, not one each, and one that waits a second takes the turn held longest.
On a port listening on loopback alone (the default), a request whose `Host:` names another host is
refused (421): a web page whose name an attacker turns to 127.0.0.1 (DNS rebinding) reaches the
port as its own origin and could read /stats.json; a browser always sends the name it used, and
loopback's own names and addresses (`localhost`, `*.localhost`, 127.0.0.1, [::1]) cannot be turned.
A request gevent's handler refuses (400: a bad request line, too many headers) is one warning in
the server's log, naming the client and the reason, never a bare traceback or line on stderr.
Every reply, gevent's refusals too, carries `HEADERS`: the page's Content-Security-Policy, no
sniffing, no referrer, no framing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
import structlog
from gevent.lock import BoundedSemaphore
from gevent.pywsgi import WSGIHandler, WSGIServer

from kestrel.service import metrics
from kestrel.service.dashboard import Dashboard
from kestrel.service.listener import Listener, is_loopback, peer_text
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.status import Status
from kestrel.service.stats_render import Pieces, stats_json, stats_text
from kestrel.service.turns import step_aside

log = structlog.get_logger("kestrel.admin")

Answer = tuple[str, str, bytes | Pieces]  # HTTP status line, content type, body (a page: its pieces)

# Connections the admin port holds at once; more wait in the listen backlog. Probes, scrapes and
# pages need a few: 450 idle ones took the descriptors a queue port's clients needed (under
# `ulimit -n 400`, a memcache client waited 29 s, until their `request_timeout`).
ADMIN_CONNECTIONS = 128
# Answers of the pages that cost a pass over every queue, rendered or being sent at once (each holds
# its page: megabytes with thousands of queues); more wait their turn, within `request_timeout`.
PAGES_AT_ONCE = 4
# How long a page's request waits for a turn before it takes the one held longest (`_PageTurns`).
PAGE_TURN_WAIT_S = 1.0

# On every reply of the port, in its handler (`_TimedHandler`): the page, its JSON, the figures, the
# probes, 404s and gevent's own refusals alike. The page may load nothing but from its own origin (no
# inline script or style, no request elsewhere), so that a server-provided string that slipped
# through unescaped still could not run or reach out; no reply may be framed, sniffed into another
# type (a queue name holding `<script>` in /stats.txt stays text) or name its URL to another site.
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = [("Content-Security-Policy", POLICY), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY")]
# The same as lines of an answer gevent writes whole: its refusals of an unreadable request (400, 414).
_HEADER_LINES = "".join(f"{name}: {value}\r\n" for name, value in HEADERS).encode("latin-1")

# The statuses in which the server takes each kind of client's requests (NotConfigured: always Up).
READY_FOR = {
    "/ready": (Status.UP, Status.NOT_CONFIGURED),
    "/ready/read": (Status.UP, Status.READ_ONLY, Status.NOT_CONFIGURED),
}


def readiness(server: ServerState, path: str) -> Answer:
    status = server.status.current
    label = Status.UP.label if status == Status.NOT_CONFIGURED else status.label
    if server.shutdown_requested.is_set():
        return "503 Service Unavailable", "text/plain", b"shutting down\n"
    if status in READY_FOR[path]:
        return "200 OK", "text/plain", f"{label}\n".encode()
    return "503 Service Unavailable", "text/plain", f"{label}\n".encode()


class _TimedHandler(WSGIHandler):  # type: ignore[misc]  # (gevent has no type hints)
    """gevent's HTTP/1.1 handler, each request of a connection within `request_timeout`, stepping
    aside before each after the first (src/kestrel/service/turns.py): gevent's handler answers the
    requests a client pipelines one after another without waiting, so one client sending `/ping`
    in a loop held every queue port for as long as it sent."""

    answered = False

    def handle_one_request(self) -> Any:
        if self.answered:
            step_aside()
        self.answered = True
        worker = gevent.getcurrent()
        waiting = self.server.waiting
        waiting[worker] = None  # until its request is in (`handle_one_response`)
        try:
            with gevent.Timeout(self.server.request_timeout_s, False):
                result = super().handle_one_request()
                if isinstance(result, tuple):  # a refusal gevent writes whole: `HEADERS` too
                    status, answer = result
                    result = status, answer.removesuffix(b"\r\n") + _HEADER_LINES + b"\r\n"
                return result
            return None  # out of time: the connection closes
        finally:
            waiting.pop(worker, None)

    def handle_one_response(self) -> Any:
        worker = gevent.getcurrent()
        self.server.waiting.pop(worker, None)  # the request is in: answering it
        answering = self.server.answering
        answering[worker] = None
        try:
            return super().handle_one_response()
        finally:
            answering.pop(worker, None)

    def start_response(self, status: str, headers: Iterable[tuple[str, str]], exc_info: Any = None) -> Any:
        """Every reply's headers, the application's and gevent's own error pages (a 500), with
        `HEADERS`: the place every reply of the port passes but the refusals `handle_one_request`
        gives them to."""
        return super().start_response(status, [*headers, *HEADERS], exc_info)

    def handle_error(self, kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        """An answer that ran out of `request_timeout` while being written (a client reading it that
        slowly) reaches gevent's handler of internal errors, which logged it as an uncaught error
        with its traceback: it is the request's time-out, which closes the connection."""
        if isinstance(error, gevent.Timeout):
            raise error
        super().handle_error(kind, error, traceback)

    def _handle_client_error(self, ex: BaseException) -> Any:
        """A request refused as the client's fault: gevent prints the traceback of one that is not a
        ValueError (http.client's "got more than 100 headers") to stderr; it is the same refusal."""
        if not isinstance(ex, (ValueError, OSError)):
            ex = ValueError(str(ex) or type(ex).__name__)
        return super()._handle_client_error(ex)

    def log_error(self, msg: str, *args: Any) -> None:
        """gevent's note of a request it refused or could not answer, as a line of the server's log,
        the client written as every port's lines write it (`peer_text`), in the reason too."""
        client = self.client_address
        peer = peer_text(client) if isinstance(client, tuple) and len(client) >= 2 else str(client)
        args = tuple(peer if arg is client else arg for arg in args)
        try:
            reason = msg % args if args else msg
        except (TypeError, ValueError):
            reason = f"{msg!r} {args!r}"
        log.warning("admin request refused", client=peer, reason=reason)


def _close_oldest(workers: dict[gevent.Greenlet, None]) -> bool:
    """Kill the worker of `workers` (oldest first) that has been there longest, closing its
    connection; False when there is none."""
    oldest = next(iter(workers), None)
    if oldest is None:
        return False
    del workers[oldest]
    oldest.kill(block=False)
    return True


class _AdminWSGIServer(WSGIServer):  # type: ignore[misc]
    handler_class = _TimedHandler

    def __init__(self, server: ServerState, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = server
        # The workers whose connection waits for a request (its line, its headers), oldest first,
        # and those answering one.
        self.waiting: dict[gevent.Greenlet, None] = {}
        self.answering: dict[gevent.Greenlet, None] = {}

    def make_room(self) -> None:
        """Close the connection that has waited longest for a request, or else the one that has
        been answering longest, for a client waiting to connect to a full port: stalled clients
        (`ADMIN_CONNECTIONS` of them, sending nothing or reading a page a few bytes at a time, held
        the port until their `request_timeout`, /ping and /ready unanswered meanwhile) and idle
        keep-alives give way to the probe, which sends its request at once. An answer takes
        milliseconds, so the oldest is the one a client is not reading."""
        if not _close_oldest(self.waiting):
            _close_oldest(self.answering)

    @property
    def request_timeout_s(self) -> float:
        return self._state.config.request_timeout / 1000.0


class _PageTurns:
    """The turns of the answers of the pages that pass over every queue, `PAGES_AT_ONCE` at once.
    A request that has waited `PAGE_TURN_WAIT_S` for one takes the turn held longest, closing its
    connection: a page takes milliseconds, so a turn held that long is a client reading its answer
    too slowly (four such held every page for their `request_timeout`)."""

    def __init__(self) -> None:
        self._free = BoundedSemaphore(PAGES_AT_ONCE)
        self._holders: dict[gevent.Greenlet, None] = {}  # oldest first

    def take(self) -> gevent.Greenlet:
        if not self._free.acquire(timeout=PAGE_TURN_WAIT_S):
            _close_oldest(self._holders)  # its answer's `close` gives its turn back
            self._free.acquire()
        worker = gevent.getcurrent()
        self._holders[worker] = None
        return worker

    def give_back(self, worker: gevent.Greenlet) -> None:
        self._holders.pop(worker, None)
        self._free.release()


class _HeldPage:
    """A page's answer, its turn held until the handler has sent it or given up: WSGI's `close`,
    which gevent calls whatever became of the answer."""

    def __init__(self, body: list[bytes], turns: _PageTurns, worker: gevent.Greenlet) -> None:
        self.body, self.turns, self.worker = body, turns, worker

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        if self.body:
            self.body = []
            self.turns.give_back(self.worker)


def reply(start_response: Callable[..., Any], status: str, headers: list[tuple[str, str]],
          body: bytes | Pieces) -> list[bytes]:
    """Every answer's headers say its length, so a HEAD's (its body left out) says the GET's; a
    page's pieces are written one after another (`stats_render.Pieces`)."""
    pieces = [body] if isinstance(body, bytes) else body
    if not status.startswith("304 "):  # a 304 has no body, and its length would be the page's
        headers = [*headers, ("Content-Length", str(sum(map(len, pieces))))]
    start_response(status, headers)
    return pieces


def names_loopback(host: str) -> bool:
    """Whether a `Host:` header's value (a name or address, and a port) names this machine's
    loopback: a name no DNS answer can turn elsewhere."""
    name = host.rpartition("]")[0].removeprefix("[") if host.startswith("[") else host.partition(":")[0]
    name = name.lower().removesuffix(".")
    return is_loopback(name) or name.endswith(".localhost")


def make_admin_server(server: ServerState, listener: tuple[str, int]) -> Listener:
    """HTTP/1.1 on gevent's WSGI handler, accepted by the shared listener so that it stops with the rest."""
    ok = "200 OK"
    routes: dict[str, Callable[[], Answer]] = {
        "/ping": lambda: (ok, "text/plain", b"pong\n"),
        "/ready": lambda: readiness(server, "/ready"),
        "/ready/read": lambda: readiness(server, "/ready/read"),
        "/stats.json": lambda: (ok, "application/json", stats_json(server)),
        "/stats.txt": lambda: (ok, "text/plain", stats_text(server)),
        "/metrics": lambda: (ok, metrics.CONTENT_TYPE_LATEST, metrics.render(server)),
        "/metrics/per-queue": lambda: (ok, metrics.CONTENT_TYPE_LATEST, metrics.render_per_queue(server)),
    }
    pages = {"/stats.json", "/stats.txt", "/metrics", "/metrics/per-queue"}  # a pass over every queue
    page_turns = _PageTurns()
    dashboard = Dashboard(server)

    loopback_only = is_loopback(listener[0])

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        answer: list[bytes] | _HeldPage
        host = environ.get("HTTP_HOST")
        if loopback_only and host is not None and not names_loopback(host):
            log.warning("admin request for another host refused", host=host[:200],
                        client=peer_text((environ["REMOTE_ADDR"], environ["REMOTE_PORT"])))
            answer = reply(start_response, "421 Misdirected Request", [("Content-Type", "text/plain")],
                           f"this admin port listens on {listener[0]} and answers requests for localhost "
                           f"or a loopback address only, not {host[:200]!r} (a web page whose name "
                           f"leads here?)\n".encode())
        elif environ.get("PATH_INFO") not in pages:
            answer = respond(environ, start_response)
        else:
            worker = page_turns.take()
            try:
                answer = _HeldPage(respond(environ, start_response), page_turns, worker)
            except BaseException:
                page_turns.give_back(worker)
                raise
        if environ.get("REQUEST_METHOD") == "HEAD":
            # Its headers alone (gevent's handler would send the body, which a keep-alive client
            # then reads as the next answer's status line).
            if isinstance(answer, _HeldPage):
                answer.close()
            return []
        return answer

    def respond(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return reply(start_response, "405 Method Not Allowed",
                         [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")],
                         b"the admin port answers GET and HEAD only\n")
        path = environ.get("PATH_INFO", "")
        route = routes.get(path)
        if route is not None:
            status, content_type, body = route()
            return reply(start_response, status, [("Content-Type", content_type)], body)
        page = dashboard.respond(path, environ.get("QUERY_STRING", ""), environ.get("HTTP_IF_NONE_MATCH"))
        if page is not None:
            return reply(start_response, *page)
        return reply(start_response, "404 Not Found", [("Content-Type", "text/plain")],
                     f"not found: try /, {', '.join(routes)}\n".encode())

    wsgi = _AdminWSGIServer(server, listener, app, log=None, environ={"SERVER_NAME": listener[0]})
    return Listener("admin", listener, wsgi.handle, min(server.config.max_connections, ADMIN_CONNECTIONS),
                    server.config.tcp_keepalive, cooperative=True, make_room=wsgi.make_room)
