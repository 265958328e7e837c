"""Serving the admin page: its files from the package, its figures as JSON, read-only.

The page is `static/index.html` at `/`; its scripts, styles and the charting library are under
`/dashboard/`, read from the package once; it polls `/dashboard/overview.json` and, on a queue's
page, `/dashboard/queue.json?name=<queue>`. The admin port gives every reply its
Content-Security-Policy, which forbids the page any source but its own origin, and the headers
beside it (`HEADERS` in src/kestrel/service/admin.py).
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from importlib.resources.abc import Traversable
from urllib.parse import parse_qs

from kestrel.service.dashboard.figures import Figures
from kestrel.service.dashboard.queue_page import queue_document
from kestrel.service.session.server_state import ServerState

PREFIX = "/dashboard/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
JSON_TYPE = "application/json"

Reply = tuple[str, list[tuple[str, str]], bytes]


class StaticFile:
    def __init__(self, body: bytes, content_type: str) -> None:
        self.body = body
        self.content_type = content_type
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def load_static() -> dict[str, StaticFile]:
    """The page's files by URL path: index.html at `/`, the others under PREFIX."""
    files: dict[str, StaticFile] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif (kind := CONTENT_TYPES.get("." + entry.name.rpartition(".")[2])) is not None:
                files[f"{prefix}{entry.name}"] = StaticFile(entry.read_bytes(), kind)

    walk(resources.files(__package__).joinpath("static"), PREFIX)
    files["/"] = files.pop(f"{PREFIX}index.html")
    return files


class Dashboard:
    """The admin port's page: `respond` answers its paths and None for any other."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.figures = Figures(server)
        self._files: dict[str, StaticFile] | None = None  # read on the first request

    def respond(self, path: str, query: str, if_none_match: str | None) -> Reply | None:
        if path == f"{PREFIX}overview.json":
            return _json(self.figures.snapshot().body)
        if path == f"{PREFIX}queue.json":
            # (a byte that is not UTF-8 is the lone surrogate the name holds for it: `encodeName`)
            name = parse_qs(query, errors="surrogateescape").get("name", [""])[0]
            document = queue_document(self.server, self.figures, name) if name else None
            if document is None:
                return "404 Not Found", [("Content-Type", JSON_TYPE)], json.dumps(
                    {"error": f"no queue {name!r}"}).encode()
            return _json(json.dumps(document, separators=(",", ":")).encode())
        if self._files is None:
            self._files = load_static()
        found = self._files.get(path)
        if found is None:
            return None
        headers = [("ETag", found.etag), ("Cache-Control", "no-cache")]
        if if_none_match == found.etag:
            return "304 Not Modified", headers, b""
        return "200 OK", [("Content-Type", found.content_type), *headers], found.body


def _json(body: bytes) -> Reply:
    return "200 OK", [("Content-Type", JSON_TYPE), ("Cache-Control", "no-store")], body
