"""The admin page as a person sees it: a real server, its page open in a real headless Chromium.

The page loads without a console error, shows the queues the test made with their counts, draws a
burst of puts, shows a damaged queue as refused with its remedy, follows a status change, says so
when the server stops answering and recovers when it is back, keeps hostile queue names as text,
and renders and filters 10,000 queues.
"""

from __future__ import annotations

import socket
import struct
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import ServerProcess
from tests.end_to_end.test_many_queues import make_queues
from tests.end_to_end.test_refused_queue import _damage
from tests.support import screenshots
from tests.support.browser import CHROMIUM, CHROMIUM_DRIVER, Browser, one_browser  # noqa: F401  (one browser)
from tests.support.lines import exchange
from tests.support.system import tool


def page(srv: ServerProcess, route: str = "") -> str:
    return f"http://127.0.0.1:{srv.admin_port}/{route}"


def put(port: int, queue: str, count: int, data: bytes = b"item") -> None:
    """`count` memcache sets to `queue`, pipelined, each answered STORED."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"set {queue} 0 0 {len(data)}\r\n".encode() + data + b"\r\n") * count)
        replies = b""
        while replies.count(b"\r\n") < count:
            chunk = s.recv(65536)
            assert chunk, f"the server closed the connection after {replies!r}"
            replies += chunk
        assert replies == b"STORED\r\n" * count, replies[:200]


def take(port: int, queue: str, count: int) -> None:
    """`count` memcache gets from `queue`, pipelined, each answered with an item."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"get {queue}\r\n".encode() * count)
        replies = b""
        while replies.count(b"END\r\n") < count:
            chunk = s.recv(65536)
            assert chunk, f"the server closed the connection after {replies[-200:]!r}"
            replies += chunk
        assert replies.count(b"VALUE ") == count, replies[-200:]


def memcache(port: int, request: bytes, end: bytes = b"\r\n") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        return exchange(s, request, end)


def shows_row(browser: Browser, name: str, **cells: str) -> bool:
    row = browser.table_rows().get(name)
    return row is not None and all(row[key] == value for key, value in cells.items())


def test_the_page_loads_without_errors_and_shows_each_queue_with_its_counts(
        server_factory: Any, browser: Browser) -> None:
    srv = server_factory({"aliases": {"everything": {"destination_queues": ["jobs", "emails"]}}})
    put(srv.memcache_port, "jobs", 3, b"0123456789")
    put(srv.memcache_port, "emails", 1)
    put(srv.memcache_port, "jobs+audit", 2)  # a fanout child of jobs, fed from now on
    put(srv.memcache_port, "jobs", 1, b"0123456789")
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=30) as reader:
        assert exchange(reader, b"get jobs/open\r\n", b"END\r\n").startswith(b"VALUE jobs")  # an open read
        browser.open(page(srv))
        browser.wait(lambda: shows_row(browser, "jobs", items="3", bytes="30 B", open_reads="1"),
                     "jobs: 3 items of 10 bytes, 1 open read")
        rows = browser.table_rows()
        assert rows["emails"]["items"] == "1" and rows["emails"]["open_reads"] == "0"
        assert rows["jobs+audit"]["items"] == "3" and rows["jobs"]["children"] == "audit"
        assert rows["jobs"]["aliases"] == rows["emails"]["aliases"] == "everything"
        assert rows["jobs"]["state"] == "serving" and rows["jobs"]["format"] == "Kestrel 2"
        assert browser.text("queue-count") == "(3)"
        assert "Memcache" in browser.text("connections")
        # A queue's own page: its figures, files and settings.
        browser.open(page(srv, "#/queue/jobs"))
        browser.wait(lambda: "Items3 (30 B)" in browser.text("q-now"), "the page of jobs")
        assert "Open reads1" in browser.text("q-now")
        assert browser.text("q-files").startswith("jobslive journal")
        assert "max_memory_size128 MB" in browser.text("q-settings")
        assert "Aliases writing hereeverything" in browser.text("q-links")
        # A fanout child's page, reached through its link (`+` in a name survives the address).
        browser.js("[...document.querySelectorAll('#q-links a')].find(a => a.textContent === 'jobs+audit').click()")
        browser.wait(lambda: browser.text("q-name") == "jobs+audit" and "Items3" in browser.text("q-now"),
                     "the page of jobs+audit")
        assert "Fanout child ofjobs" in browser.text("q-links")
    assert browser.console_errors() == []
    # Every request the page made went to its own origin.
    origin = page(srv).rstrip("/")
    requested = browser.js("return performance.getEntriesByType('resource').map(e => e.name)")
    assert requested and all(url.startswith(origin + "/") for url in requested), requested


def test_hostile_queue_names_stay_text(server_factory: Any, browser: Browser) -> None:
    srv = server_factory()
    # Queue names cannot hold `/`, `.` or whitespace, but can hold markup and quotes.
    hostile = ["<b>bold", 'x"onmouseover="top[\'pwned\']=1"x', "<script>top['pwned']=1<", "&amp;", "'--><i>"]
    for name in hostile:
        put(srv.memcache_port, name, 1)
    browser.open(page(srv))
    browser.wait(lambda: set(hostile) <= set(browser.table_rows()), "every hostile name in the table")
    shown = browser.js("return [...document.querySelectorAll('#queues tbody a')].map(a => a.textContent)")
    assert sorted(shown) == sorted(hostile)
    assert browser.js("return document.querySelectorAll('#queues b, #queues i, #queues script, [onmouseover]').length") == 0
    assert browser.js("return window.pwned") is None
    browser.open(page(srv, "#/queue/" + urllib.request.quote(hostile[1], safe="")))
    browser.wait(lambda: browser.text("q-name") == hostile[1] and "Items1" in browser.text("q-now"),
                 "the page of a hostile name")
    assert browser.js("return document.querySelectorAll('[onmouseover], main b, main script').length") == 0
    assert browser.js("return window.pwned") is None
    assert browser.console_errors() == []


def test_a_queue_whose_name_is_not_utf8_is_listed_and_has_its_page(
        tmp_path: Path, server_factory: Any, browser: Browser) -> None:
    """A Kestrel 2 journal whose file name is not UTF-8 is a name with a lone surrogate, on which
    the browser's encodeURIComponent throws: the overview drew no row of any queue and stopped."""
    queues = tmp_path / "server" / "queues"
    queues.mkdir(parents=True)
    (queues / "plain").write_bytes(b"")
    (queues / "caf\udce9").write_bytes(b"")  # the file name b"caf\xe9"
    srv = server_factory()
    put(srv.memcache_port, "plain", 2)
    browser.open(page(srv))
    browser.wait(lambda: set(browser.table_rows()) == {"plain", "caf\ufffd"} and shows_row(browser, "plain", items="2"),
                 "both queues in the table")
    hrefs = browser.js("return [...document.querySelectorAll('#queues tbody a')].map(a => a.getAttribute('href'))")
    assert sorted(hrefs) == ["#/queue/caf%E9", "#/queue/plain"]
    put(srv.memcache_port, "plain", 1)
    browser.wait(lambda: shows_row(browser, "plain", items="3"), "the overview polling on")
    browser.open(page(srv, "#/queue/caf%E9"))
    browser.wait(lambda: "Items0" in browser.text("q-now"), "the page of the queue not named in UTF-8")
    assert browser.console_errors() == []


def test_the_rate_chart_moves_after_a_burst_of_puts(server_factory: Any, browser: Browser) -> None:
    srv = server_factory()
    put(srv.memcache_port, "burst", 1)
    browser.open(page(srv))

    def highest_in() -> float:
        data = browser.js("const c = window.kestrelDashboard?.charts.rates; return c ? c.data[1] : []")
        return max((v for v in data if v is not None), default=0.0)

    # (`?.` throughout: on a loaded machine the page's script may not have run yet when it is asked)
    browser.wait(lambda: len(browser.js("return window.kestrelDashboard?.charts.rates?.data[0] ?? []")) >= 3,
                 "three points on the rate chart")
    assert highest_in() == 0 and "in 0 items/s, out 0 items/s." in browser.text("rate-caption")
    put(srv.memcache_port, "burst", 5000)
    browser.wait(lambda: highest_in() > 0, "the burst on the chart")
    assert highest_in() <= 5000  # one put per item: no more than 5000 items in a second
    assert "in 0 items/s" not in browser.text("rate-caption").split("highest")[1]
    # Taking them moves the out line.
    take(srv.memcache_port, "burst", 50)
    browser.wait(lambda: max((v or 0) for v in browser.js(
        "return window.kestrelDashboard.charts.rates.data[2]")) > 0, "items out on the chart")
    assert browser.console_errors() == []


def test_a_damaged_queue_shows_as_refused_with_the_remedy_its_refusal_gives(
        tmp_path: Path, browser: Browser) -> None:
    srv = ServerProcess(tmp_path)
    _damage(srv.queue_path)
    srv.start()
    try:
        refusal = memcache(srv.memcache_port, b"get bad\r\n").decode().rstrip()
        start = "restore the damaged file from a copy and restart; or restart with --salvage: "
        assert start in refusal
        remedy = start + refusal.split(start, 1)[1]  # what --salvage would set aside, for this damage
        browser.open(page(srv))
        browser.wait(lambda: browser.shown("refused-panel") and "bad" in browser.text("refused-list"),
                     "the refused queue")
        listed = browser.text("refused-list")
        assert "opcode 66" in listed and f"Remedy: {remedy}" in listed
        damage = refusal.split("refused at start-up: ", 1)[1].split("; " + start, 1)[0]
        assert damage in listed  # the damage as the refusal says it
        assert browser.table_rows()["bad"]["state"] == "refused"
        assert browser.table_rows()["good"]["items"] == "2"
        browser.open(page(srv, "#/queue/bad"))
        browser.wait(lambda: browser.shown("q-refused") and remedy in browser.text("q-refused-facts"),
                     "the refused queue's page")
        assert damage in browser.text("q-refused-facts") and browser.text("q-state") == "refused"
        assert browser.console_errors() == []
    finally:
        srv.stop()


def test_a_status_change_shows(server_factory: Any, browser: Browser) -> None:
    srv = server_factory()
    browser.open(page(srv))
    browser.wait(lambda: browser.text("status") == "Up", "status Up")
    assert memcache(srv.memcache_port, b"status readonly\r\n") == b"END\r\n"
    browser.wait(lambda: browser.text("status") == "ReadOnly", "status ReadOnly")
    assert "ReadOnly" in browser.text("server-facts")
    assert memcache(srv.memcache_port, b"status quiescent\r\n") == b"END\r\n"
    browser.wait(lambda: browser.text("status") == "Quiescent", "status Quiescent")
    assert browser.console_errors() == []


def test_the_page_says_when_the_server_stops_answering_and_recovers(
        server_factory: Any, browser: Browser) -> None:
    srv = server_factory()
    put(srv.memcache_port, "before", 2)
    browser.open(page(srv))
    browser.wait(lambda: shows_row(browser, "before", items="2"), "the queue")
    assert not browser.shown("offline")
    srv.stop()
    browser.wait(lambda: browser.shown("offline"), "the message that the server is not answering")
    assert "The server is not answering" in browser.text("offline")
    assert browser.shown("queues")  # the last figures stay, dimmed
    srv.start()
    put(srv.memcache_port, "after", 3)
    browser.wait(lambda: not browser.shown("offline") and shows_row(browser, "after", items="3"),
                 "the page back with the new figures")
    assert browser.js("return document.body.classList.contains('stale')") is False


def test_ten_thousand_queues_render_sort_and_filter(tmp_path: Path, browser: Browser) -> None:
    srv = ServerProcess(tmp_path)
    make_queues(srv.queue_path, 10_000)  # each with one item, as a server finds them at start
    srv.start()
    try:
        browser.open(page(srv))
        browser.wait(lambda: browser.text("queue-count") == "(10,000)", "10,000 queues", timeout=60)
        drawn = browser.table_rows()
        assert 10 < len(drawn) < 200  # only the rows in view are drawn
        assert drawn["q0"]["items"] == "1"
        # The table is as tall as 10,000 rows: scrolled to the end, the last queues are drawn.
        browser.js("const s = document.getElementById('table-scroll'); s.scrollTop = s.scrollHeight;")
        browser.wait(lambda: "q9999" in browser.table_rows(), "the last queue after scrolling to the end")
        browser.js("document.getElementById('filter').value = 'q99';"
                   "document.getElementById('filter').dispatchEvent(new Event('input'));")
        browser.wait(lambda: browser.text("queue-count") == "(111 of 10,000 match)", "the filter's matches")
        matching = {"q99", *(f"q99{n}" for n in range(10)), *(f"q99{n:02d}" for n in range(100))}
        drawn = browser.table_rows()
        assert set(drawn) <= matching and "q99" in drawn and "q990" in drawn
        browser.js("document.querySelector('#queues th[data-key=name]').click()")  # descending
        browser.wait(lambda: browser.js("return document.querySelector('#queues tbody a').textContent") == "q9999",
                     "sorted by name, descending")
        browser.js("document.getElementById('filter').value = 'q4242';"
                   "document.getElementById('filter').dispatchEvent(new Event('input'));")
        browser.wait(lambda: set(browser.table_rows()) == {"q4242"}, "one queue left by the filter")
        assert browser.console_errors() == []
    finally:
        srv.stop()


def test_the_screenshots_of_the_docs_come_from_a_real_server(tmp_path: Path) -> None:
    """tests/support/screenshots.py, which took docs/dashboard-*.png, still takes both pages."""
    tool(CHROMIUM)  # skips, naming the package, if missing
    tool(CHROMIUM_DRIVER)
    for png in screenshots.take(tmp_path, 3.0):
        head = png.read_bytes()[:24]
        width, height = struct.unpack(">II", head[16:24])
        assert head.startswith(b"\x89PNG\r\n\x1a\n") and width == 1400 and height > 900, (png, width, height)
