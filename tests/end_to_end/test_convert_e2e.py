"""The queue path's lock and `kestrel journal convert` against a real server process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, ServerProcess
from tests.server.test_shutdown import _thrift_client
from tests.support.clients import every_item


def convert(srv: ServerProcess, to: str, *queues: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kestrel", "journal", "convert", "--to", to, str(srv.queue_path), *queues]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def put(srv: ServerProcess, queue: str, items: list[bytes]) -> None:
    c = _thrift_client(srv.thrift_port)
    try:
        assert c.put(queue, items, 0) == len(items)
    finally:
        c.close()


def take_all(srv: ServerProcess, queue: str) -> list[bytes]:
    c = _thrift_client(srv.thrift_port)
    try:
        return every_item(c, queue)
    finally:
        c.close()


def serve_check(srv: ServerProcess) -> subprocess.CompletedProcess[str]:
    """`kestrel serve --check` of the server's config file, as an operator runs it before a start."""
    return subprocess.run([sys.executable, "-m", "kestrel", "serve", "--check", "--config", str(srv.config_path)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def test_convert_refuses_while_the_server_runs_and_works_once_it_stopped(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"journal_format": "kestrel2"}}})
    put(srv, "jobs", [b"one", b"two"])
    refused = convert(srv, "kestrel3")
    assert refused.returncode != 0
    assert "in use by kestrel serve (pid" in refused.stderr and "stop it first" in refused.stderr
    assert take_all(srv, "jobs") == [b"one", b"two"]  # nothing touched: the server still serves them
    put(srv, "jobs", [b"three", b"four"])
    srv.stop()

    done = convert(srv, "kestrel3")
    assert done.returncode == 0, done.stderr
    assert "jobs: converted to kestrel3: jobs 2 items" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("converted 1 queues (2 items) to kestrel3")

    # Its config still says kestrel2: start-up refuses, naming the command that converts back.
    with pytest.raises(RuntimeError, match="exited with 2"):
        srv.start()
    assert f"kestrel journal convert --to kestrel2 {srv.queue_path} jobs" in srv.log()

    back = convert(srv, "kestrel2", "jobs")
    assert back.returncode == 0, back.stderr
    srv.start()
    assert take_all(srv, "jobs") == [b"three", b"four"]


def test_a_second_server_on_the_same_queue_path_refuses_to_start(server_factory: Any, tmp_path: Path) -> None:
    first = server_factory()
    put(first, "q", [b"x"])
    (tmp_path / "second").mkdir()
    second = ServerProcess(tmp_path / "second", {"queue_path": str(first.queue_path)})
    with pytest.raises(RuntimeError, match="exited with 4"):
        second.start()
    assert f"cannot start: queue path {first.queue_path} is in use by kestrel serve (pid " in second.log()
    assert take_all(first, "q") == [b"x"]  # the first server serves on, undisturbed
    first.kill()  # a crash drops the lock with the process
    second.start()
    second.stop()


def test_a_journal_format_the_queues_files_lack_is_refused_by_the_check_and_the_reload(
        server_factory: Any) -> None:
    """A live queue keeps its files' format, and the next start refuses such a setting (exit 2): the
    check and a reload said it was fine, and the unit then stayed down after its restart."""
    import json
    import signal

    import yaml

    from tests.conftest import wait_until

    srv = server_factory({"queues": {"jobs": {"journal_format": "kestrel2"}}})
    put(srv, "jobs", [b"one"])
    srv.config_path.write_text(yaml.safe_dump(dict(srv.config, queues={"jobs": {"journal_format": "kestrel3"}})))
    checked = serve_check(srv)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert f"kestrel journal convert --to kestrel3 {srv.queue_path} jobs" in checked.stderr
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "queues.jobs.journal_format" in srv.log(), "the reload's refusal")
    refusal = next(json.loads(line) for line in srv.log().splitlines() if "queues.jobs.journal_format" in line)
    assert refusal["level"] in ("error", "warning"), refusal
    put(srv, "jobs", [b"two"])  # the settings as they were: the queue serves on
    assert take_all(srv, "jobs") == [b"one", b"two"]


@pytest.mark.parametrize("tool", ["check", "convert"])
def test_the_tools_are_refused_beside_a_server_whose_lock_file_was_removed(server_factory: Any, tool: str) -> None:
    """`check` looked at the lock files alone: with the running server's removed, it read journals
    still being written, as if no server ran."""
    srv = server_factory()
    put(srv, "q", [b"x"])
    (srv.queue_path / ".kestrel" / "lock").unlink()
    args = ["check", str(srv.queue_path)] if tool == "check" else ["convert", "--to", "kestrel3", str(srv.queue_path)]
    done = subprocess.run([sys.executable, "-m", "kestrel", "journal", *args], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "in use" in done.stderr and str(srv.queue_path) in done.stderr, done.stderr
    assert take_all(srv, "q") == [b"x"]


@pytest.mark.parametrize("queue, held, stray, content, refusal", [
    ("jobs", [b"one"], "jobs.1234.pack", b"\x01junk", r"Kestrel 2 journal files \(jobs.1234.pack\) beside Kestrel 3"),
    ("core", [], "core", b"\x7fELF\x02\x01\x01" + bytes(64), r"core is in neither journal format.* 7f 45 4c 46 .*move "),
], ids=["other-format", "neither-format"])
def test_a_stray_file_beside_a_kestrel3_queue_refuses_that_queue_alone(
        server_factory: Any, queue: str, held: list[bytes], stray: str, content: bytes, refusal: str) -> None:
    """A stray file in the queue path under kestrel3 (an editor's or a copy's `jobs.1234.pack` beside a
    Kestrel 3 queue; a `core` dumped there, in neither format) stopped the whole start with a
    `journal_format` error naming a convert command, which refused in turn, and `serve --check` called
    it a bad setting. Now `serve --check` passes, the start refuses that queue alone naming the file,
    the other queues serve, and once the file is moved out the queue serves what it held."""
    from thriftpy2.thrift import TApplicationException

    srv = server_factory({"default_queue": {"journal_format": "kestrel3"}})
    if held:
        put(srv, queue, held)
    put(srv, "other", [b"kept"])
    srv.stop()
    (srv.queue_path / stray).write_bytes(content)
    checked = serve_check(srv)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    srv.start()
    assert take_all(srv, "other") == [b"kept"]
    with pytest.raises(TApplicationException, match=refusal):
        take_all(srv, queue)
    srv.stop()
    (srv.queue_path / stray).unlink()
    srv.start()
    assert take_all(srv, queue) == held


@pytest.mark.parametrize("fmt", ["kestrel3", "kestrel2"])
def test_a_stray_file_put_in_the_queue_path_while_the_server_runs_refuses_its_queue_alone(
        server_factory: Any, fmt: str) -> None:
    """A file in neither format named as queue `core`'s journal (a core dumped into the queue path)
    while the server runs, before `core` was first named: under kestrel3 a put made the queue beside
    it and acknowledged items the next start refused with it; under kestrel2 it was answered as a
    journal damaged at offset 0. Now the first request refuses the queue as a start does, and every
    protocol answers that refusal, naming the file; the server serves the others, and once the file
    is moved out the next start serves the queue."""
    from thriftpy2.thrift import TApplicationException

    from tests.support.wire import conn, exchange, memcache_stats

    core = b"\x7fELF\x02\x01\x01" + bytes(64)
    srv = server_factory({"default_queue": {"journal_format": fmt}})
    put(srv, "other", [b"kept"])
    (srv.queue_path / "core").write_bytes(core)
    for _ in range(2):
        with pytest.raises(TApplicationException, match=r"queue 'core' is not served: .* refused as it was first "
                                                        r"named after start-up: file .*/core is in neither journal "
                                                        r"format.* 7f 45 4c 46 .*move "):
            put(srv, "core", [b"x"])
    with conn(srv.memcache_port) as s:
        reply = exchange(s, b"set core 0 0 1\r\nx\r\n", b"\r\n").decode()
    assert reply.startswith("SERVER_ERROR queue 'core' is not served") and "neither journal format" in reply
    assert memcache_stats(srv.memcache_port)["refused_queue_core"] == "1"
    put(srv, "other", [b"more"])
    assert take_all(srv, "other") == [b"kept", b"more"]
    assert srv.stop() == 0
    assert sorted(p.name for p in srv.queue_path.iterdir() if p.name.startswith("core")) == ["core"]
    assert (srv.queue_path / "core").read_bytes() == core
    (srv.queue_path / "core").unlink()
    srv.start()
    put(srv, "core", [b"y"])
    assert take_all(srv, "core") == [b"y"]
