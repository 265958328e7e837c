"""The YAML configuration: defaults, the documented example, and errors that name the key."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kestrel.service.config import (
    EXAMPLE,
    MAX_CONNECTIONS,
    MAX_KEEPALIVE_MS,
    ServerConfig,
    default_memory_total,
    from_mapping,
    load,
    with_overrides,
)
from kestrel.storage.config import MAX_DURATION_MS
from kestrel.storage.errors import ConfigError
from tests.support.clients import thrift


def test_documented_example_loads_with_every_default() -> None:
    config = load(str(EXAMPLE))
    defaults = ServerConfig()
    for key in ("thrift_port", "memcache_port", "text_port", "admin_port", "max_open_reads",
                "expiration_timer_frequency", "max_frame_size", "thrift_transport", "thrift_protocol",
                "default_status", "status_file", "max_line_length", "max_connections"):
        assert getattr(config, key) == getattr(defaults, key), key
    queue = config.queues.for_queue("anything")
    assert queue == config.queues.default
    from kestrel.storage.config import QueueConfig
    assert queue == QueueConfig()


def test_example_documents_every_key() -> None:
    text = (EXAMPLE).read_text()
    from dataclasses import fields

    from kestrel.storage.config import QueueConfig
    for f in fields(ServerConfig):
        if f.name not in ("source", "overridden", "file_keys"):
            assert f"\n{f.name}:" in text, f.name
    for f in fields(QueueConfig):
        assert f"  {f.name}:" in text, f.name


@pytest.mark.parametrize("data, key", [
    ({"thrift_prot": 1}, "thrift_prot"),
    ({"thrift_port": 70000}, "thrift_port"),
    ({"thrift_transport": "http"}, "thrift_transport"),
    ({"default_status": "down"}, "default_status"),
    ({"max_frame_size": "huge"}, "max_frame_size"),
    ({"queues": {"q": {"max_items": -1}}}, "queues.q.max_items"),
    ({"default_queue": {"sync_journal": "often"}}, "default_queue.sync_journal"),
    ({"aliases": {"a": {"destination_queues": "q"}}}, "aliases.a.destination_queues"),
    ({"aliases": {"a": {"targets": ["q"]}}}, "aliases.a.targets"),
    # an alias that reaches itself: each put went round to the recursion limit, a copy a turn
    ({"aliases": {"x": {"destination_queues": ["q", "y"]}, "y": {"destination_queues": ["x"]}}},
     "aliases.x.destination_queues"),
    ({"commit_log": "sometimes"}, "commit_log"),
])
def test_bad_values_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(data)
    assert err.value.key == key


@pytest.mark.parametrize("text, on", [("off", False), ("on", True), ("'on'", True), ("'OFF'", False)])
def test_commit_log_is_on_or_off_quoted_or_not(tmp_path: Path, text: str, on: bool) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text(f"commit_log: {text}\n")
    assert load(str(path)).commit_log is on


def test_the_commit_log_is_on_unless_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text("thrift_port: 2229\n")
    assert load(str(path)).commit_log is True and ServerConfig().commit_log is True


def test_command_line_overrides() -> None:
    config = with_overrides(ServerConfig(), thrift_port=1234, queue_path=None)
    assert config.thrift_port == 1234 and config.queue_path == ServerConfig().queue_path


def test_bad_file_stops_the_server_with_the_key_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("queues:\n  jobs:\n    max_size: lots\n")
    proc = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "queues.jobs.max_size" in proc.stderr and "lots" in proc.stderr


def test_queue_settings_are_parsed_once_and_shared_by_start_and_reload(tmp_path: Path) -> None:
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\ndefault_queue:\n  max_items: 10\nqueues:\n  jobs:\n    max_items: 5\n")
    config = load(str(path))
    assert config.queues.for_queue("jobs").max_items == 5 and config.queues.for_queue("x").max_items == 10
    server = ServerState(config)
    assert server.collection.configs is config.queues  # start uses what load parsed
    path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  jobs:\n    max_items: 7\n")
    server.reload()
    assert server.collection.configs is server.config.queues  # reload parses the file once, too
    assert server.config.queues.for_queue("jobs").max_items == 7
    server.close()


def test_a_reload_that_fails_with_an_error_saying_nothing_logs_what_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its line said `error=""` for an exception with no message (a MemoryError reading the file)."""
    from structlog.testing import capture_logs

    from kestrel.service import config as config_module
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\n")
    server = ServerState(load(str(path)))
    monkeypatch.setattr(config_module, "load", lambda source: (_ for _ in ()).throw(MemoryError()))
    try:
        with capture_logs() as logs, pytest.raises(MemoryError):
            server.reload()
        assert [e["error"] for e in logs if e["event"].startswith("reload failed")] == ["MemoryError()"]
    finally:
        server.close()


def test_a_reload_of_a_server_started_without_a_file_is_refused_and_says_why(tmp_path: Path) -> None:
    """A server started without --config answered a memcache `reload` with `Reloaded config.` though
    nothing was read; it is refused as a failed reload is, in its one log line, and the client told."""
    import gevent
    import gevent.socket
    from structlog.testing import capture_logs

    from kestrel.service.memcache.handler import MemcacheConnection
    from kestrel.service.session.server_state import ServerState

    server = ServerState(ServerConfig(queue_path=str(tmp_path)))
    server.collection.load()
    ours, theirs = gevent.socket.socketpair()
    try:
        with capture_logs() as logs:
            with pytest.raises(ConfigError, match="reload: no config file"):
                server.reload()
            theirs.sendall(b"reload\r\n")
            theirs.shutdown(socket.SHUT_WR)
            gevent.spawn(MemcacheConnection(server, ours, "test").run).get(timeout=10)
        assert theirs.recv(4096) == (b"SERVER_ERROR reload: no config file: the server was started "
                                     b"without --config\r\n")
        assert [(e["event"], e["requested_by"]) for e in logs if "requested_by" in e] == [
            ("reload failed; keeping the current settings", "SIGHUP"),
            ("reload failed; keeping the current settings", "memcache client test")]
    finally:
        theirs.close()
        server.close()


@pytest.mark.parametrize("text", ["", "# queues:\n#   jobs: {sync_journal: always}\n", "\n\n", "~\n"])
def test_a_reload_of_a_file_that_sets_nothing_is_refused_and_keeps_the_settings(tmp_path: Path, text: str) -> None:
    """An emptied or cut off file read as one asking for every default reset each queue's settings,
    `sync_journal: always` to `never`, with a warning about the server's own keys only. Refused, as
    a broken file is; a file that sets something (`queues: {}`) still resets on purpose."""
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  jobs: {{sync_journal: always}}\n")
    server = ServerState(load(str(path)))
    try:
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"kestrel\.yaml: holds no settings \(empty, or only comments\), "
                                              r"while the running config sets queue_path, queues: "):
            server.reload()
        assert server.collection.configs.for_queue("jobs").sync_journal == 0  # always, still
        path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues: {{}}\n")
        server.reload()
        assert server.collection.configs.for_queue("jobs").sync_journal is None  # reset, as asked
    finally:
        server.close()
    path.write_text("")  # a server started from a file that set nothing reloads one that sets nothing
    server = ServerState(dataclasses.replace(load(str(path)), queue_path=str(tmp_path / "q")))
    try:
        server.reload()
    finally:
        server.close()


def test_queues_without_settings_of_their_own_share_the_default_settings(tmp_path: Path) -> None:
    """One settings object for every queue the file does not name (each put and get reads it: with
    10,000 queues, 10,000 copies were out of the CPU's caches); a named queue, and a fanout reader
    of one, get their own."""
    from kestrel.storage import QueueCollection
    from kestrel.storage.config import QueueConfigs

    configs = QueueConfigs({"max_items": 10}, {"jobs": {"max_items": 5}})
    assert configs.for_queue("a") is configs.default and configs.for_queue("b+r") is configs.default
    assert configs.for_queue("jobs").max_items == 5 and configs.for_queue("jobs+r").max_items == 5
    coll = QueueCollection(str(tmp_path), configs)
    coll.load()
    try:
        assert all(coll.queue(f"q{i}").config is configs.default for i in range(3))
        assert coll.queue("jobs").config.max_items == 5 and coll.queue("q0").config.max_items == 10
    finally:
        coll.close()


def test_the_memory_budget_is_on_by_default_a_quarter_of_memory_and_off_at_zero() -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    unset = from_mapping({}).max_memory_total
    assert 0 < unset <= physical // 4 and unset == default_memory_total()
    assert from_mapping({"max_memory_total": "auto"}).max_memory_total == unset
    assert from_mapping({"max_memory_total": 0}).max_memory_total == 0
    assert from_mapping({"max_memory_total": "2GB"}).max_memory_total == 2 << 30
    with pytest.raises(ConfigError, match="max_memory_total.*0 \\(no budget\\) or auto, got 'lots'"):
        from_mapping({"max_memory_total": "lots"})


def _machine(tmp_path: Path, cgroup: str, files: dict[str, str], mem_total_kb: int = 16 << 20) -> tuple[str, str]:
    """Fake /proc and /sys roots: the process's cgroup lines, MemTotal, and cgroup files by path."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(f"MemTotal:       {mem_total_kb} kB\nMemFree:        1024 kB\n")
    for path, text in files.items():
        (sys_root / "fs" / "cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (sys_root / "fs" / "cgroup" / path).write_text(text + "\n")
    return str(proc), str(sys_root)


GIB = 1 << 30
V1_NONE = "9223372036854771712"  # what cgroup v1 says where no limit is set


@pytest.mark.parametrize("cgroup, files, budget", [
    # v2, systemd's MemoryMax= on the service's own cgroup: the root has no memory.max
    ("0::/system.slice/kestrel.service\n",
     {"system.slice/memory.max": "max", "system.slice/kestrel.service/memory.max": str(GIB)}, GIB // 4),
    # a parent's limit binds its children, set or not
    ("0::/a/b\n", {"a/memory.max": str(2 * GIB), "a/b/memory.max": "max"}, 2 * GIB // 4),
    ("0::/a/b\n", {"a/memory.max": str(2 * GIB), "a/b/memory.max": str(3 * GIB)}, 2 * GIB // 4),
    # a cgroup namespace: the process's cgroup is the mount's root
    ("0::/\n", {"memory.max": str(GIB)}, GIB // 4),
    # none set anywhere: the machine's memory
    ("0::/a\n", {"a/memory.max": "max"}, 16 * GIB // 4),
    # v1: the memory controller's line, and a huge value is no limit
    ("5:cpu,cpuacct:/x\n4:memory:/docker/c1\n0::/\n",
     {"memory/memory.limit_in_bytes": V1_NONE, "memory/docker/memory.limit_in_bytes": V1_NONE,
      "memory/docker/c1/memory.limit_in_bytes": str(GIB)}, GIB // 4),
    ("4:memory:/docker/c1\n", {"memory/memory.limit_in_bytes": V1_NONE}, 16 * GIB // 4),
    # a limit above the machine's memory changes nothing
    ("0::/a\n", {"a/memory.max": str(64 * GIB)}, 16 * GIB // 4),
])
def test_auto_budget_is_a_quarter_of_the_smallest_limit_of_the_server_s_cgroup_and_its_ancestors(
        tmp_path: Path, cgroup: str, files: dict[str, str], budget: int) -> None:
    assert default_memory_total(*_machine(tmp_path, cgroup, files)) == budget


def test_auto_budget_without_cgroup_files_is_a_quarter_of_the_machine(tmp_path: Path) -> None:
    proc, sys_root = _machine(tmp_path, "", {}, mem_total_kb=8 << 20)
    assert default_memory_total(proc, sys_root) == 8 * GIB // 4
    assert default_memory_total(str(tmp_path / "none"), sys_root) > 0  # no meminfo: sysconf's figure


def test_a_server_at_every_limit_s_bound_serves_each_protocol_and_keeps_its_items(server_factory: Any) -> None:
    """The largest counts, sizes and durations the config takes (tests/server/test_config_errors.py)
    are ones the server holds: the C readers take their limits, gevent's pool its size, the kernel
    its keepalive, and an item under the longest `max_age` is journaled in both formats and read
    back after a restart."""
    from pymemcache.client.base import Client

    largest = 2**63 - 1
    srv = server_factory({
        "max_frame_size": largest, "max_batch_items": largest, "max_batch_bytes": largest,
        "max_line_length": largest, "max_open_reads": largest, "max_connections": MAX_CONNECTIONS,
        "tcp_keepalive": f"{MAX_KEEPALIVE_MS}ms",
        "default_queue": {"max_age": f"{MAX_DURATION_MS}ms", "max_items": largest, "max_size": largest},
        "queues": {"k3": {"journal_format": "kestrel3"}},
    })
    with thrift(srv) as client:
        assert client.put("k2", [b"thrift"], 0) == 1
        assert client.put("k3", [b"thrift"], 0) == 1
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=10)
    assert mc.set("k2", b"memcache", noreply=False) and mc.set("k3", b"memcache", noreply=False)
    mc.close()
    with socket.create_connection(("127.0.0.1", srv.text_port), timeout=10) as text:
        text.sendall(b"put k2:\ntext\n\n")
        assert text.recv(100) == b"+1\n"
    srv.restart()
    with thrift(srv) as client:
        assert [item.data for item in client.get("k2", 10, 0, 0)] == [b"thrift", b"memcache", b"text"]
        assert [item.data for item in client.get("k3", 10, 0, 0)] == [b"thrift", b"memcache"]


def test_a_fanout_child_in_another_journal_format_than_its_parent_is_refused(tmp_path: Path) -> None:
    """A child is kept in its parent's format: its own setting would go unheeded until the next start
    refused the files made meanwhile. Refused at a start and at a reload, naming the child."""
    from kestrel.service.session.server_state import ServerState

    with pytest.raises(ConfigError, match=r"queues\.p\+c\.journal_format: kestrel3, but a fanout child is kept "
                                          r"in its parent's journal format, and queue 'p' is kestrel2"):
        from_mapping({"queues": {"p": {}, "p+c": {"journal_format": "kestrel3"}}})
    # Inherited, the child's format is its parent's: nothing to refuse.
    inherited = from_mapping({"default_queue": {"journal_format": "kestrel3"},
                              "queues": {"p": {"journal_format": "kestrel2"}, "p+c": {"max_items": 3}}})
    assert inherited.queues.for_queue("p+c").journal_format == "kestrel2"
    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  p: {{}}\n")
    server = ServerState(load(str(path)))
    try:
        server.collection.put("p", [b"kept"])
        path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  p: {{}}\n  p+c:\n    journal_format: kestrel3\n")
        with pytest.raises(ConfigError, match=r"queues\.p\+c\.journal_format"):
            server.reload()
        assert server.collection.configs.for_queue("p+c").journal_format == "kestrel2"  # the old settings
    finally:
        server.close()


def test_a_reload_reads_its_file_off_the_loop_and_the_last_begun_applies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of configured queues take a second to read: the clients are served meanwhile. A
    reload whose reading ends after a later one's began applies nothing: the later one read the file
    as it was then."""
    import time

    import gevent

    from kestrel.service import config as config_module
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"

    def write(max_items: int) -> None:
        path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  jobs:\n    max_items: {max_items}\n")

    write(5)
    server = ServerState(load(str(path)))
    real_load, loads = config_module.load, []

    def slow_first(source: str) -> Any:
        loaded = real_load(source)
        loads.append(loaded.queues.for_queue("jobs").max_items)
        if len(loads) == 1:
            time.sleep(0.5)  # in the reading's thread: the loop runs on
        return loaded

    monkeypatch.setattr(config_module, "load", slow_first)
    turns: list[float] = []
    ticking = gevent.spawn(lambda: [(turns.append(time.monotonic()), gevent.sleep(0.01)) for _ in range(30)])
    try:
        write(7)
        first = gevent.spawn(server.reload)
        while not loads:  # the first has read the file (7), and is still at it
            gevent.sleep(0.01)
        write(9)
        server.reload()  # begun later, ended first: applies 9
        first.get(timeout=10)
        assert loads == [7, 9] and server.collection.configs.for_queue("jobs").max_items == 9
        assert len(turns) >= 10  # the loop ran while the first reading took half a second
    finally:
        ticking.kill()
        server.close()


@pytest.mark.parametrize("later", ["applies", "fails"])
def test_a_reload_overtaken_by_a_later_one_ends_as_that_one_does_in_one_log_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, later: str) -> None:
    """A reload whose reading ends after a later one's began applies nothing: it returned in silence,
    no line in the log, and the memcache `reload` it served answered `Reloaded config.` though the
    later one had failed and nothing had changed. It ends as the later one does, and says so."""
    import time

    import gevent
    from structlog.testing import capture_logs

    from kestrel.service import config as config_module
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  jobs:\n    max_items: 5\n")
    server = ServerState(load(str(path)))
    real_load, loads = config_module.load, []

    def slow_first(source: str) -> Any:
        loaded = real_load(source)
        loads.append(loaded)
        if len(loads) == 1:
            time.sleep(0.3)  # in the reading's thread, the file read: the later reload begins meanwhile
        return loaded

    monkeypatch.setattr(config_module, "load", slow_first)
    try:
        with capture_logs() as logs:
            first = gevent.spawn(partial(server.reload, "memcache client 1"))
            while not loads:
                gevent.sleep(0.01)
            if later == "applies":
                path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  jobs:\n    max_items: 9\n")
                server.reload("memcache client 2")
                first.get(timeout=10)  # answered `Reloaded config.`: the file as it then was applied
                assert server.collection.configs.for_queue("jobs").max_items == 9
            else:
                path.write_text("queues: [cut short\n")
                with pytest.raises(ConfigError, match="not valid YAML"):
                    server.reload("memcache client 2")
                with pytest.raises(ConfigError, match="not valid YAML"):  # a SERVER_ERROR to its client
                    first.get(timeout=10)
                assert server.collection.configs.for_queue("jobs").max_items == 5
        ends = [(e["event"], e["requested_by"], e["log_level"]) for e in logs if "requested_by" in e]
        outcome, level = (("applied the file as it then was", "info") if later == "applies"
                          else ("failed; keeping the current settings", "error"))
        assert ends[-1] == (f"reload folded into a later one, which {outcome}", "memcache client 1", level)
        assert [e["later_requested_by"] for e in logs if "later_requested_by" in e] == ["memcache client 2"]
        assert len(ends) == (1 if later == "applies" else 2)  # the later one's failure is its own line
    finally:
        server.close()
