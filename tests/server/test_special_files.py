"""A FIFO or a device where the server expects a regular file (a queue's journal, its config file)
never holds the event loop: `open` of a FIFO waits for its other end, and `read` of a device never
ends. The file is refused with its kind named, and every other client is served meanwhile."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ServerProcess, wait_until
from tests.support.wire import conn, exchange


def ping(srv: ServerProcess) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/ping", timeout=5) as reply:
        return bytes(reply.read()).strip()


def test_a_fifo_where_a_queue_s_journal_goes_is_refused_and_the_server_serves_on(server_factory: Any) -> None:
    srv: ServerProcess = server_factory({})
    os.mkfifo(srv.queue_path / "fq")
    s = conn(srv.memcache_port)
    started = time.monotonic()
    reply = exchange(s, b"set fq 0 0 1\r\nx\r\n")
    assert time.monotonic() - started < 5
    assert reply.startswith(b"SERVER_ERROR") and b"not a regular file but a FIFO" in reply, reply
    assert ping(srv) == b"pong"
    assert exchange(s, b"set other 0 0 2\r\nok\r\n") == b"STORED\r\n"
    assert exchange(s, b"get other\r\n", b"END\r\n") == b"VALUE other 0 2\r\nok\r\nEND\r\n"


def test_a_reload_from_a_fifo_is_refused_and_the_server_serves_on(server_factory: Any) -> None:
    srv: ServerProcess = server_factory({})
    srv.config_path.unlink()
    os.mkfifo(srv.config_path)
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "not a regular file but a FIFO" in srv.log(), "the reload refused")
    assert ping(srv) == b"pong"
    s = conn(srv.memcache_port)
    assert exchange(s, b"set q 0 0 1\r\nx\r\n") == b"STORED\r\n"


def test_config_check_of_a_device_ends_with_an_error(tmp_path: Path) -> None:
    for path in ("/dev/zero", "/dev/null"):
        out = subprocess.run([sys.executable, "-m", "kestrel", "config", "check", path], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0
        assert "not a regular file but a character device" in out.stderr, out.stderr


def test_a_fifo_among_the_commit_log_s_segments_or_a_queue_s_files_ends_each_reader_with_an_error(
        tmp_path: Path) -> None:
    """Start-up's recovery, `journal check` and `journal dump` read the commit log's segments and a
    queue's files through the one open that refuses what is not a regular file."""
    segments = tmp_path / "q" / ".kestrel" / "commit-log"
    segments.mkdir(parents=True)
    os.mkfifo(segments / "1")
    os.mkfifo(tmp_path / "q" / "jobs.1700000000000")  # where a queue's rotated journal would be
    runs = [["serve", "--queue-path", str(tmp_path / "q"), "--listen-address=127.0.0.1", "--thrift-port=0",
             "--memcache-port=0", "--text-port=0", "--admin-port=0"],
            ["journal", "check", str(tmp_path / "q")],
            ["journal", "dump", str(tmp_path / "q" / "jobs.1700000000000")]]
    for args in runs:
        out = subprocess.run([sys.executable, "-m", "kestrel", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0, args
        assert "not a regular file but a FIFO" in out.stderr + out.stdout, (args, out.stderr, out.stdout)


@pytest.mark.parametrize("name, warning", [("read_ids", "ignoring an unreadable read-id floor")])
def test_a_fifo_in_the_place_of_a_file_start_up_reads_is_not_waited_on(tmp_path: Path, name: str,
                                                                       warning: str) -> None:
    """Start-up reads the read ids' floor through the same open: a FIFO there is refused (the ids
    start from the clock, and a warning says why) instead of holding the process before it serves
    (the floor's own open held it for good). A FIFO as the status file stops the start:
    tests/server/test_startup_failures.py."""
    (tmp_path / "q" / ".kestrel").mkdir(parents=True)
    os.mkfifo(tmp_path / "q" / ".kestrel" / name)
    server = subprocess.Popen(
        [sys.executable, "-m", "kestrel", "serve", "--queue-path", str(tmp_path / "q"), "--thrift-port=0",
         "--memcache-port=0", "--text-port=0", "--admin-port=0", "--log-format=json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while not any("kestrel started" in line for line in lines):
            ready, _, _ = select.select([server.stdout], [], [], max(deadline - time.monotonic(), 0))
            line = server.stdout.readline() if ready else ""
            if not line:
                break  # out of time (a start held by the FIFO says nothing), or the process ended
            lines.append(line)
        assert any("kestrel started" in line for line in lines), lines
        assert any(warning in line and "not a regular file but a FIFO" in line for line in lines), lines
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
