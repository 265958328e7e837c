"""HTTP sent to a line protocol's port: the request of a web page, refused before its body runs.

A page in a browser on a machine that reaches the server can make it POST to the memcache or text
port (`fetch(url, {method: "POST", mode: "no-cors", body: "flush_all\\r\\n"})` needs no preflight):
the request line and headers are refused as unknown commands, and the body's lines, read as
commands, would run. Both line protocols close a connection at the first line that is HTTP, as
Redis does, so nothing after it is read. HTTP/1.1 names the host in every request, and a browser
sends `Host:` before any other header, so one of the two lines below comes first.
"""

from __future__ import annotations


def speaks_http(words: list[str]) -> bool:
    """Whether a command line, split into its words, is an HTTP request line (`POST / HTTP/1.1`)
    or a `Host:` header: no command of either protocol reads so."""
    if len(words) == 3 and words[2].startswith("HTTP/"):
        return True
    return bool(words) and words[0].lower().startswith("host:")


def http_refusal(port: str) -> str:
    """The error a connection that spoke HTTP gets before it is closed."""
    return f"HTTP request on the {port} port (an HTTP client or a web page?): closing the connection"
