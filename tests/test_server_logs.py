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
