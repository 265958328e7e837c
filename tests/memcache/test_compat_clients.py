"""Third-party memcache clients against the real server: each finding a client once tripped on.

pymemcache, python-memcached and pylibmc come from the test extra; libmemcached's command-line
tools from Debian's libmemcached-tools, installed here when missing (skipped, saying why, when the
machine cannot install them). docs/protocols.md's compatibility table lists what these tests cover.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client as PymemcacheClient

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support import system
from tests.support.wire import (
    close_sockets,  # noqa: F401  (autouse: closes the sockets before the servers stop)
    conn,
    exchange,
    memcache_stats,
    shared_server,  # noqa: F401  (the module's `server`)
)


def address(server: ServerProcess) -> str:
    return f"127.0.0.1:{server.memcache_port}"


@pytest.fixture
def pymc(server: ServerProcess) -> Iterator[PymemcacheClient]:
    """pymemcache with its defaults (noreply on for set and flush_all)."""
    client = PymemcacheClient(("127.0.0.1", server.memcache_port), timeout=5)
    yield client
    client.close()


@pytest.fixture
def pmc(server: ServerProcess) -> Iterator[Any]:
    memcache = pytest.importorskip("memcache", reason="python-memcached is not installed")
    client = memcache.Client([address(server)], socket_timeout=30, dead_retry=0)
    yield client
    client.disconnect_all()


@pytest.fixture
def libmc(server: ServerProcess) -> Any:
    pylibmc = pytest.importorskip("pylibmc", reason="pylibmc has no binary wheel for this platform")
    return pylibmc.Client([address(server)], behaviors={"cas": True})


def tool(command: str) -> str:
    return system.tool(command, "libmemcached-tools")


def run_tool(server: ServerProcess, command: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([tool(command), f"--servers={address(server)}", *args], capture_output=True,
                          timeout=30)


# ---------------------------------------------------------------------------------------------
# pymemcache


def test_pymemcache_gets_parses_the_cas_field(pymc: PymemcacheClient) -> None:
    assert pymc.set("pym_gets", b"kept", noreply=False)
    assert pymc.gets("pym_gets") == (b"kept", b"0")
    assert pymc.get("pym_gets") is None  # dequeued once, and delivered


def test_pymemcache_flush_all_noreply_leaves_no_stray_reply(pymc: PymemcacheClient) -> None:
    assert pymc.set("pym_flush", b"x", noreply=False)
    assert pymc.flush_all() is True  # pymemcache's default: flush_all 0 noreply
    assert pymc.set("pym_flush", b"after", noreply=False)
    assert pymc.get("pym_flush") == b"after"


def test_pymemcache_get_many_gets_the_first_key(pymc: PymemcacheClient) -> None:
    pymc.set("pym_a", b"1", noreply=False)
    pymc.set("pym_b", b"2", noreply=False)
    assert pymc.get_many(["pym_a", "pym_b"]) == {"pym_a": b"1"}
    assert pymc.get("pym_b") == b"2"


def test_pymemcache_reliable_read_and_blocking_get(pymc: PymemcacheClient) -> None:
    pymc.set("pym_rel", b"job", noreply=False)
    assert pymc.get("pym_rel/open") == b"job"
    assert pymc.get("pym_rel/close") is None
    start = time.monotonic()
    assert pymc.get("pym_rel/t=50") is None
    assert time.monotonic() - start >= 0.04


def test_pymemcache_version_and_stats(pymc: PymemcacheClient) -> None:
    assert pymc.version().startswith(b"2.4.1")
    assert b"curr_connections" in pymc.stats()


# ---------------------------------------------------------------------------------------------
# python-memcached


def test_python_memcached_set_get_delete(pmc: Any) -> None:
    assert pmc.set("pm_basic", "value")
    assert pmc.get("pm_basic") == b"value"
    assert pmc.set("pm_basic", "gone")
    assert pmc.delete("pm_basic")
    assert pmc.get("pm_basic") is None


def test_python_memcached_gets_parses_the_cas_field(pmc: Any) -> None:
    assert pmc.set("pm_gets", "kept")
    assert pmc.gets("pm_gets") == b"kept"
    assert pmc.get("pm_gets") is None


def test_python_memcached_get_multi_answers_at_once(pmc: Any) -> None:
    pmc.set("pm_a", "1")
    pmc.set("pm_b", "2")
    start = time.monotonic()
    assert pmc.get_multi(["pm_a", "pm_b"]) == {"pm_a": b"1"}
    assert time.monotonic() - start < STALL_S  # not at its 30 s socket timeout
    assert pmc.get("pm_b") == b"2"  # the server was not marked dead


def test_python_memcached_flush_all_and_stats(pmc: Any) -> None:
    assert pmc.set("pm_flush", "x")
    ((_, before),) = pmc.get_stats()
    assert int(before["queue_pm_flush_items"]) == 1
    pmc.flush_all()
    ((_, stats),) = pmc.get_stats()
    assert int(stats["queue_pm_flush_items"]) == 0 and int(stats["curr_items"]) == 0
    assert pmc.get("pm_flush") is None


# ---------------------------------------------------------------------------------------------
# pylibmc (libmemcached)


def test_pylibmc_set_get_delete_and_get_multi(libmc: Any) -> None:
    assert libmc.set("pl_a", b"1")
    assert libmc.set("pl_b", b"2")
    assert libmc.get_multi(["pl_a", "pl_b"]) == {"pl_a": b"1"}
    assert libmc.delete("pl_b")
    assert libmc.get("pl_b") is None


def test_pylibmc_gets_parses_the_cas_field(libmc: Any) -> None:
    assert libmc.set("pl_gets", b"kept")
    assert libmc.gets("pl_gets") == (b"kept", 0)


def test_pylibmc_stats(libmc: Any) -> None:
    ((_, stats),) = libmc.get_stats()
    assert "uptime" in stats


def test_pylibmc_binary_protocol_fails_at_once(server: ServerProcess) -> None:
    pylibmc = pytest.importorskip("pylibmc", reason="pylibmc has no binary wheel for this platform")
    client = pylibmc.Client([address(server)], binary=True, behaviors={"_poll_timeout": 30_000})
    start = time.monotonic()
    with pytest.raises(pylibmc.Error):
        client.set("pl_binary", b"x")
    assert time.monotonic() - start < STALL_S  # refused and closed, not left to its 30 s poll timeout
    assert "binary protocol request refused" in server.log()


# ---------------------------------------------------------------------------------------------
# libmemcached's command-line tools


def test_memcping_accepts_the_version(server: ServerProcess) -> None:
    done = run_tool(server, "memcping")
    assert done.returncode == 0, done.stderr


def test_memcstat_reads_version_and_stats(server: ServerProcess) -> None:
    done = run_tool(server, "memcstat", "--server-version")
    assert done.returncode == 0 and (done.stdout + done.stderr).strip().endswith(b" 2.4.1"), done
    done = run_tool(server, "memcstat")
    assert done.returncode == 0 and b"curr_connections" in done.stdout, done


def test_memccp_memccat_memcrm_round_trip(server: ServerProcess, tmp_path: Path) -> None:
    item = tmp_path / "tool_item"  # the key is the file's name (no dot: queue names refuse one)
    item.write_bytes(b"from a file")
    assert run_tool(server, "memccp", str(item)).returncode == 0
    assert run_tool(server, "memccat", "tool_item").stdout == b"from a file\n"  # memccat adds the newline
    assert memcache_stats(server.memcache_port)["queue_tool_item_items"] == "0"
    item.write_bytes(b"to delete")
    assert run_tool(server, "memccp", str(item)).returncode == 0
    assert run_tool(server, "memcrm", "tool_item").returncode == 0
    assert not (server.queue_path / "tool_item").exists()


def test_memcflush_gets_kestrels_reply(server: ServerProcess) -> None:
    # Kestrel answers flush_all with "Flushed all queues."; libmemcached wants "OK" and reports a
    # read failure, although the queues are flushed.
    with conn(server.memcache_port) as s:
        assert exchange(s, b"set tool_flush 0 0 1\r\nx\r\n") == b"STORED\r\n"
    done = run_tool(server, "memcflush")
    assert b"Flushed all queues." in done.stderr
    wait_until(lambda: memcache_stats(server.memcache_port)["queue_tool_flush_items"] == "0", "the flush to empty the queue")
