"""What the server log says about client actions: each event once."""

from __future__ import annotations

import json
from typing import Any

from pymemcache.client.base import Client as MemcacheClient


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
