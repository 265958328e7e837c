"""What the server log says about client actions: each event once."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import gevent
import pytest
import yaml
from pymemcache.client.base import Client as MemcacheClient

from kestrel.storage.fsync.completion_cpu import completion_cpu
from kestrel.storage.fsync.group_commit import native_threads
from kestrel.storage.runtime import GeventRuntime
from tests.conftest import PACKAGE_ROOT, ServerProcess, free_port, wait_for_port, wait_until


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


def test_the_fsync_rounds_run_on_the_cpu_that_takes_the_disks_completions_where_one_does(
        server_factory: Any) -> None:
    """A disk with one queue finishes every write on the CPU its interrupt goes to: the server runs
    its rounds there and names it in its start line (`fsync_cpu`); on any other disk, no CPU."""
    srv = server_factory()
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    (started,) = [e for e in events if e["event"] == "kestrel started"]
    cpu = completion_cpu(str(srv.queue_path))
    assert started.get("fsync_cpu") == (None if native_threads() is None else cpu)


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


def test_lines_logged_from_the_pools_threads_beside_the_loops_all_come_whole() -> None:
    """A pack or a config load logs from one of the pool's threads while greenlets log on the loop:
    a gevent lock on the writes hung the thread and its waiting caller for good."""
    code = ("from gevent import monkey; monkey.patch_all()\n"
            "import logging, gevent, structlog\n"
            "from kestrel.service.logs import configure_logging\n"
            "configure_logging(log_format='json')\n"
            "log = structlog.get_logger('t')\n"
            "def in_thread(n):\n"
            "    for i in range(n):\n"
            "        log.info('thread', i=i)\n"
            "        logging.getLogger('lib').warning('library %d', i)\n"
            "def on_loop(n):\n"
            "    for i in range(n):\n"
            "        log.info('loop', i=i)\n"
            "        gevent.sleep(0)\n"
            "pool = gevent.get_hub().threadpool\n"
            "tasks = [gevent.spawn(on_loop, 500) for _ in range(3)] + [pool.spawn(in_thread, 500) for _ in range(3)]\n"
            "assert len(gevent.wait(tasks, timeout=30)) == 6, 'a writer hung'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    events = [json.loads(line)["event"] for line in done.stderr.splitlines()]
    assert events.count("loop") == 1500 and events.count("thread") == 1500
    assert sum(e.startswith("library ") for e in events) == 1500


def test_a_console_line_shows_a_clients_control_characters_escaped() -> None:
    code = ("import structlog\n"
            "from kestrel.service.logs import configure_logging\n"
            "configure_logging(log_format='console')\n"
            "log = structlog.get_logger('t')\n"
            "log.warning('malformed thrift request', method='ab\\x00\\x1b[2Jcd')  # no space nor line break: not quoted\n"
            "try:\n"
            "    raise ValueError('x')\n"
            "except ValueError:\n"
            "    log.exception('failed')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    first, *rest = done.stderr.splitlines()
    assert "method=ab\\x00\\x1b[2Jcd" in first
    assert "\x1b" not in done.stderr and "\x00" not in done.stderr
    assert "Traceback (most recent call last):" in rest  # a traceback keeps its lines


def test_one_stream_one_format_and_what_each_queue_did(tmp_path: Path) -> None:
    """With --log-format json, every line is JSON on stderr, stdout stays empty: the environment
    variable's warning, a queue loaded at start-up (not "created"), a refused one, a new one."""
    srv = ServerProcess(tmp_path)
    srv.queue_path.mkdir()
    (srv.queue_path / "kept").write_bytes(b"")  # an empty journal: loaded
    (srv.queue_path / "broken").write_bytes(b"\x42" * 10)  # an unknown opcode: refused
    config = dict(srv.config, queue_path=str(srv.queue_path))
    srv.config_path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "kestrel", "serve", "--config", str(srv.config_path),
                             "--log-format", "json", "--listen-address", "0.0.0.0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, KESTREL_FSYNC="bogus", PYTHONPATH=str(PACKAGE_ROOT)))
    try:
        wait_for_port(srv.memcache_port, proc)
        mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5, default_noreply=False)
        try:
            assert mc.set("fresh", b"x")
        finally:
            mc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert out == b""
    events = [json.loads(line) for line in err.decode().splitlines()]  # each line is one JSON object
    said = {(e["event"], e.get("queue")) for e in events}
    assert {("queue loaded", "kept"), ("queue created", "fresh")} <= said
    assert ("queue created", "kept") not in said
    assert any("REFUSED" in e["event"] and e.get("queue") == "broken" for e in events)
    assert any("KESTREL_FSYNC" in e["event"] and e.get("value") == "bogus" for e in events)
    assert any(e["event"].startswith("listening beyond this machine") for e in events)
    started = next(e for e in events if e["event"] == "kestrel started")
    assert started["queue_path"] == str(srv.queue_path) and os.path.isabs(started["queue_path"])


def test_the_start_line_names_the_queue_path_in_full(tmp_path: Path) -> None:
    port = free_port()
    done = subprocess.Popen([sys.executable, "-m", "kestrel", "serve", "--queue-path", "rel/queues",
                             "--thrift-port", "0", "--text-port", "0", "--admin-port", "0",
                             "--memcache-port", str(port), "--log-format", "json"],
                            cwd=tmp_path, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    try:
        wait_for_port(port, done)
    finally:
        done.send_signal(signal.SIGTERM)
        _, err = done.communicate(timeout=30)
    started = next(json.loads(line) for line in err.decode().splitlines() if "kestrel started" in line)
    assert started["queue_path"] == str(tmp_path / "rel" / "queues")
    assert started["listen_address"] == "127.0.0.1"  # every listener, admin included, unless told
    assert not any("listening beyond" in line for line in err.decode().splitlines())


def test_a_reload_names_the_settings_only_a_restart_applies(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"max_items": 5}}})
    changed = dict(srv.config, thrift_port=free_port(), max_wait="1min",
                   queues={"jobs": {"max_items": 7}})
    srv.config_path.write_text(yaml.safe_dump(changed))
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload ignored" in srv.log(), "the reload's warning")
    line = json.loads(next(line for line in srv.log().splitlines() if "reload ignored" in line))
    assert line["keys"] == ["thrift_port", "max_wait"] and "restart" in line["event"]
    assert line["config"] == str(srv.config_path)
    stats = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        assert stats.set("jobs", b"x")  # the queue setting applied; the server still on its old ports
    finally:
        stats.close()


def test_a_reload_of_an_emptied_file_is_refused_and_a_reload_names_each_queue_it_changes(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"sync_journal": "always"}, "mail": {"max_items": 5}}})
    stats = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        assert stats.set("jobs", b"x", noreply=False) and stats.set("mail", b"y", noreply=False)  # stored
        srv.config_path.write_text("")  # cut off: nothing of the file reached the disk
        with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as mc:
            mc.sendall(b"reload\r\n")
            reply = mc.recv(1000)
            assert reply.startswith(b"SERVER_ERROR ") and b"holds no settings (empty, or only comments)" in reply
            mc.sendall(b"dump_config\r\n")
            assert b"sync_journal=always" in mc.recv(10_000)  # the settings kept
        wait_until(lambda: "reload failed" in srv.log(), "the refused reload's line")
        assert "reload changed" not in srv.log()
        srv.config_path.write_text(yaml.safe_dump(dict(srv.config, queues={"mail": {"max_items": 5}})))
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload changed" in srv.log(), "the reload's line for the queue it reset")
        lines = [json.loads(line) for line in srv.log().splitlines() if "reload changed" in line]
        assert [(line["queues"], line["keys"], line["was"], line["now"]) for line in lines] == [
            (["jobs"], ["sync_journal"], {"sync_journal": "always"}, {"sync_journal": "never"})]
    finally:
        stats.close()


@pytest.mark.parametrize("noreply", [False, True])
def test_a_failed_reload_is_logged_whoever_asked_for_it(server_factory: Any, noreply: bool) -> None:
    srv = server_factory({"queues": {"jobs": {"max_items": 5}}})
    srv.config_path.write_text(yaml.safe_dump(dict(srv.config, queues={"jobs": {"max_items": "banana"}})))
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as mc:
        if noreply:
            mc.sendall(b"reload noreply\r\nversion\r\n")
            assert mc.recv(100).startswith(b"VERSION ")  # the reload answered nothing
        else:
            mc.sendall(b"reload\r\n")
            assert mc.recv(500).startswith(b"SERVER_ERROR queues.jobs.max_items")
    wait_until(lambda: "reload failed" in srv.log(), "the failed reload's line")
    line = json.loads(next(line for line in srv.log().splitlines() if "reload failed" in line))
    assert "queues.jobs.max_items" in line["error"] and line["requested_by"].startswith("memcache client 127.0.0.1:")


def test_the_start_line_names_the_status_file_where_it_is(server_factory: Any) -> None:
    """A relative `status_file` is from the directory the server starts in; the start now says where."""
    srv = server_factory({"status_file": "status-here"})
    started = [json.loads(line) for line in srv.log().splitlines() if '"kestrel started"' in line][-1]
    assert started["status_file"] == str(srv.workdir / "status-here")  # the server runs in its workdir
    assert os.path.isabs(started["queue_path"])
