"""The admin HTTP port: /ping, /stats.json, /stats.txt and Prometheus /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gevent.pywsgi import WSGIServer

from service.server import KestrelServer
from service.stats_render import prometheus, stats_json, stats_text


def make_admin_server(server: KestrelServer, listener: tuple[str, int]) -> WSGIServer:
    routes: dict[str, tuple[str, Callable[[], bytes]]] = {
        "/ping": ("text/plain", lambda: b"pong\n"),
        "/stats.json": ("application/json", lambda: stats_json(server)),
        "/stats.txt": ("text/plain", lambda: stats_text(server)),
        "/metrics": ("text/plain; version=0.0.4", lambda: prometheus(server)),
    }

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None or environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /ping, /stats.json, /stats.txt or /metrics\n"]
        content_type, render = route
        body = render()
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return WSGIServer(listener, app, log=None)
