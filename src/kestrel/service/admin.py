"""The admin HTTP port: /ping, /stats.json, /stats.txt, Prometheus /metrics, and the page at /."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gevent.pywsgi import WSGIServer

from kestrel.service import metrics
from kestrel.service.dashboard import Dashboard
from kestrel.service.listener import Listener
from kestrel.service.session.server_state import ServerState
from kestrel.service.stats_render import stats_json, stats_text


def make_admin_server(server: ServerState, listener: tuple[str, int]) -> Listener:
    """HTTP/1.1 on gevent's WSGI handler, accepted by the shared listener so that it stops with the rest."""
    routes: dict[str, tuple[str, Callable[[], bytes]]] = {
        "/ping": ("text/plain", lambda: b"pong\n"),
        "/stats.json": ("application/json", lambda: stats_json(server)),
        "/stats.txt": ("text/plain", lambda: stats_text(server)),
        "/metrics": (metrics.CONTENT_TYPE_LATEST, lambda: metrics.render(server)),
    }
    dashboard = Dashboard(server)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        route = routes.get(path)
        reading = environ.get("REQUEST_METHOD") in ("GET", "HEAD")
        if route is None and reading:
            page = dashboard.respond(path, environ.get("QUERY_STRING", ""), environ.get("HTTP_IF_NONE_MATCH"))
            if page is not None:
                status, headers, body = page
                start_response(status, headers)
                return [body]
        if route is None or not reading:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /, /ping, /stats.json, /stats.txt or /metrics\n"]
        content_type, render = route
        body = render()
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    wsgi = WSGIServer(listener, app, log=None, environ={"SERVER_NAME": listener[0]})
    return Listener("admin", listener, wsgi.handle, server.config.max_connections,
                    server.config.tcp_keepalive, cooperative=True)
