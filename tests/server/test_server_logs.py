"""What the server log says about client actions: each event once."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from typing import Any

import gevent
import pytest
from pymemcache.client.base import Client as MemcacheClient

from kestrel.storage.runtime import GeventRuntime


def test_a_queue_delete_is_logged_once(server_factory: Any) -> None:
    srv = server_factory()
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("doomed", b"x")
        assert mc.delete("doomed")
    finally:
        mc.close()
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    assert [e["queue"] for e in events if e["event"] == "queue deleted"] == ["doomed"]


def test_a_queue_first_used_by_a_client_is_logged_once_with_its_address(server_factory: Any) -> None:
    srv = server_factory()
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("fresh", b"x")
        assert mc.get("fresh") == b"x"
        assert mc.get("fresh") is None
        local_port = mc.sock.getsockname()[1]
    finally:
        mc.close()
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    firsts = [e for e in events if e.get("queue") == "fresh" and e["event"] in (
        "queue created", "queue referenced for the first time")]
    assert [(e["event"], e["client"]) for e in firsts] == [("queue created", f"127.0.0.1:{local_port}")]


def test_a_failed_blocking_call_is_reported_once_by_its_caller_only(capfd: pytest.CaptureFixture[str]) -> None:
    # A pack failing with ENOSPC in the pool printed gevent's bare traceback before the queue's own
    # structured "packing failed" line: the pool must say nothing, the caller gets the error.
    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def caller() -> OSError | None:
        try:
            GeventRuntime().run_blocking(full_disk)
        except OSError as e:
            return e
        return None

    error = gevent.spawn(caller).get()
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert capfd.readouterr().err == ""


def test_an_error_no_greenlet_caught_is_one_structured_line() -> None:
    code = ("import gevent, errno\n"
            "from kestrel.service.logs import configure_logging\n"
            "configure_logging()\n"
            "def boom():\n"
            "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "gevent.spawn(boom).join()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    event = json.loads(lines[0])
    assert event["event"] == "uncaught error" and "No space left on device" in event["exception"]
