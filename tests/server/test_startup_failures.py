"""A server that cannot start says so in one line, naming what, where and why, and exits with the
documented code (src/kestrel/service/startup.py, `kestrel serve --help`): the real command, as a subprocess."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kestrel.service.config import EXAMPLE
from tests.conftest import PACKAGE_ROOT, STARTED, ServerProcess, free_port
from tests.support.privileges import as_plain_user

NO_LISTENERS = ["--thrift-port=0", "--memcache-port=0", "--text-port=0", "--admin-port=0"]


def kestrel(*args: str, command: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kestrel serve ARGS` (JSON logs) run to its end, after `command` (e.g. setpriv) if given; a
    start that succeeds is a failure here."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
    argv = [*(command or []), sys.executable, "-m", "kestrel", "serve", "--log-format=json", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the server started: {e.stderr!r}") from None


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and not done.stdout, done.stderr + done.stdout
    assert lines[0].startswith("kestrel: cannot start: "), lines[0]
    return lines[0]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process's listener holds (SO_REUSEADDR as the server sets it, so only a
    listening socket, not a TIME_WAIT, stops the bind)."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_port_in_use_names_the_listener_and_the_address(tmp_path: Path, held_port: int) -> None:
    memcache = free_port()
    done = kestrel("--queue-path", str(tmp_path / "q"), "--listen-address=127.0.0.1",
                   f"--thrift-port={free_port()}", f"--memcache-port={memcache}", f"--text-port={held_port}",
                   "--admin-port=0")
    line = one_line(done)
    assert done.returncode == 5
    assert f"text listener 127.0.0.1:{held_port}: Address already in use" in line, line
    assert "another process holds that port (a listener, or one end of a connection" in line, line
    # The listeners already open were closed: the port is free again.
    with socket.socket() as again:
        again.bind(("127.0.0.1", memcache))


def test_an_address_this_machine_lacks_names_listen_address(tmp_path: Path) -> None:
    done = kestrel("--queue-path", str(tmp_path / "q"), "--listen-address=192.0.2.1", *NO_LISTENERS[1:],
                   f"--thrift-port={free_port()}")
    line = one_line(done)
    assert done.returncode == 5
    assert "thrift listener 192.0.2.1:" in line and "listen_address" in line, line


def test_a_queue_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "queues"
    path.write_text("not a directory")
    done = kestrel("--queue-path", str(path), *NO_LISTENERS)
    assert one_line(done) == f"kestrel: cannot start: queue path {path}: exists and is not a directory"
    assert done.returncode == 4
    assert_checked_as_refused(path)


def test_a_queue_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = kestrel("--queue-path", str(tmp_path / "file" / "q"), *NO_LISTENERS)
    assert f"queue path {tmp_path / 'file' / 'q'}: Not a directory" in one_line(done)
    assert done.returncode == 4
    assert_checked_as_refused(tmp_path / "file" / "q")


def assert_checked_as_refused(path: Path) -> None:
    """`serve --check` refuses a queue path a start cannot use because of a file in its way (it
    said ok)."""
    checked = kestrel("--queue-path", str(path), "--check")
    assert checked.returncode == 2, (checked.stdout, checked.stderr)
    assert checked.stderr.startswith(f"kestrel: bad configuration: queue_path: queue path {path}: "
                                     "Not a directory (the path or one of its parents is a file)"), checked.stderr


def test_a_queue_path_the_user_may_not_write(tmp_path: Path) -> None:
    parent = tmp_path / "spool"
    parent.mkdir()
    parent.chmod(0o555)
    command = as_plain_user()  # root writes anywhere: without the capabilities that let it
    try:
        done = kestrel("--queue-path", str(parent / "kestrel"), *NO_LISTENERS, command=command)
    finally:
        parent.chmod(0o755)
    line = one_line(done)
    assert done.returncode == 4
    assert f"queue path {parent / 'kestrel'}: Permission denied (the server runs as user " in line, line


def test_a_queue_path_whose_own_directory_is_writable_but_not_the_path(tmp_path: Path) -> None:
    """The server's own directory (`.kestrel`) writable, the queue path itself not: it started, and
    each new queue failed with an internal error."""
    queues = tmp_path / "queues"
    (queues / ".kestrel").mkdir(parents=True)
    queues.chmod(0o555)
    try:
        done = kestrel("--queue-path", str(queues), *NO_LISTENERS, command=as_plain_user())
    finally:
        queues.chmod(0o755)
    line = one_line(done)
    assert done.returncode == 4
    assert f"queue path {queues}: Permission denied (the server runs as user " in line, line


def test_a_queue_path_on_a_read_only_file_system(tmp_path: Path) -> None:
    """EROFS, as on a disk remounted read-only: a read-only bind mount in a mount namespace of its own."""
    unshare = shutil.which("unshare")
    readonly = tmp_path / "ro"
    (readonly / "queues").mkdir(parents=True)
    mount = f"mount --bind {readonly} {readonly} && mount -o remount,bind,ro {readonly}"
    if unshare is None or subprocess.run([unshare, "-m", "sh", "-c", mount], capture_output=True).returncode:
        pytest.skip("no private mount namespace here (needs root and unshare) to make a read-only mount")
    script = f'{mount} && exec "$@"'
    for path, what in ((readonly / "new", str(readonly / "new")),
                       (readonly / "queues", f"{readonly / 'queues'}: {readonly / 'queues' / '.kestrel'}")):
        done = kestrel("--queue-path", str(path), *NO_LISTENERS,
                       command=[unshare, "-m", "sh", "-c", script, "sh"])
        assert one_line(done) == f"kestrel: cannot start: queue path {what}: Read-only file system"
        assert done.returncode == 4


def test_a_status_file_that_cannot_be_written(tmp_path: Path) -> None:
    config = tmp_path / "kestrel.yaml"
    status = tmp_path / "missing" / "status"
    config.write_text(f"queue_path: {tmp_path / 'q'}\nstatus_file: {status}\n")
    done = kestrel("--config", str(config), *NO_LISTENERS)
    assert one_line(done) == (f"kestrel: cannot start: status file {status}: No such file or directory "
                              f"(its directory does not exist)")
    assert done.returncode == 4


@pytest.mark.parametrize("kind", ["a journal", "the config file", "other text", "a FIFO", "a device"])
def test_a_status_file_that_is_no_status_file_is_refused_and_left_as_it_is(tmp_path: Path, kind: str) -> None:
    """Any client may change the status, which replaces the status file: one naming a journal, the
    config file or a device was replaced at the first change (a journal's items lost; as root,
    /dev/null made a regular file). Each is refused at start, naming why, and left as it was."""
    queues, config = tmp_path / "q", tmp_path / "kestrel.yaml"
    queues.mkdir()
    (queues / "jobs").write_bytes(b"\x02\x05\x00\x00\x00hello")
    (tmp_path / "notes").write_text("hello world\n")
    os.mkfifo(tmp_path / "fifo")
    status = {"a journal": queues / "jobs", "the config file": config, "other text": tmp_path / "notes",
              "a FIFO": tmp_path / "fifo", "a device": Path("/dev/null")}[kind]
    config.write_text(f"queue_path: {queues}\nstatus_file: {status}\n")
    before = status.read_bytes() if status.is_file() else None
    done = kestrel("--config", str(config), *NO_LISTENERS)
    why = {"a journal": f"in the queue path beside the journals, where names are queues': keep it in "
                        f"{queues}/.kestrel/ (the default) or outside the queue path",
           "the config file": "it holds b'queue_path: ",
           "other text": "it holds b'hello world\\n', not a status (up, readonly or quiescent): not a status "
                         "file, which a status change would replace",
           "a FIFO": "not a regular file but a FIFO", "a device": "not a regular file but a character device"}[kind]
    assert one_line(done).startswith(f"kestrel: cannot start: status file {status}: {why}")
    assert done.returncode == 4
    assert (status.read_bytes() if status.is_file() else None) == before
    checked = kestrel("--config", str(config), "--check")  # which also reads the queue path
    assert checked.returncode == 2 and f"status_file: status file {status}: {why}" in checked.stderr, checked


def test_a_status_file_where_no_file_can_be_created_is_refused_saying_so(tmp_path: Path) -> None:
    """`/proc` says ENOENT to a new file: the refusal said the status file's directory did not exist."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    config = tmp_path / "kestrel.yaml"
    config.write_text(f"queue_path: {tmp_path / 'q'}\nstatus_file: /proc/kestrel-status\n")
    done = kestrel("--config", str(config), *NO_LISTENERS)
    assert one_line(done) == ("kestrel: cannot start: status file /proc/kestrel-status: no file can be "
                              "created in its directory /proc")
    assert done.returncode == 4


def test_a_queue_path_another_server_holds(server_factory: Any) -> None:
    first: ServerProcess = server_factory()
    done = kestrel("--queue-path", str(first.queue_path), *NO_LISTENERS)
    line = one_line(done)
    assert done.returncode == 4
    assert f"queue path {first.queue_path} is in use by kestrel serve (pid {first.proc.pid})" in line, line


def test_a_queue_path_whose_lock_file_was_removed_is_still_held(server_factory: Any) -> None:
    """A lock file removed while its server runs (taken for a stale one) let a second server lock
    a new file of that name and write the same journals: an acknowledged item was lost."""
    first: ServerProcess = server_factory()
    (first.queue_path / ".kestrel" / "lock").unlink()
    done = kestrel("--queue-path", str(first.queue_path), *NO_LISTENERS)
    line = one_line(done)
    assert done.returncode == 4
    assert first.proc is not None
    assert (f"queue path {first.queue_path} is in use by pid {first.proc.pid} (") in line, line
    assert "which holds the directory's lock although its lock file" in line and "kestrel" in line, line
    assert first.proc is not None and first.proc.poll() is None


def test_out_of_file_descriptors(tmp_path: Path) -> None:
    """With ever more descriptors allowed, each start that fails for want of them says so in one line
    and exits 6, until one is enough and the server starts."""
    ports = [f"--{name}-port={free_port()}" for name in ("thrift", "memcache", "text", "admin")]
    failures = []
    for limit in range(8, 64):
        def limit_files(limit: int = limit) -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
        log = tmp_path / f"server-{limit}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kestrel", "serve", "--log-format=json",
                                     "--queue-path", str(tmp_path / "q"), *ports],
                                    stdout=out, stderr=out, env=env, preexec_fn=limit_files)
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=15)
        text = log.read_text()
        if code is None:
            assert STARTED in text, text
            break
        lines = text.splitlines()
        assert code == 6 and len(lines) == 1, f"limit {limit}: exit {code}: {text}"
        assert "Too many open files" in lines[0] and f"the process may open {limit} files" in lines[0]
        failures.append(lines[0])
    else:
        raise AssertionError("the server never started")
    assert failures, "the lowest limit tried was already enough"


def test_a_bad_config_lists_every_bad_key_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "kestrel.yaml"
    config.write_text("thrift_port: 70000\nqueues:\n  jobs:\n    max_size: lots\n    max_items: -1\n")
    done = kestrel("--config", str(config))
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert [line.split(": ")[2] for line in lines] == ["thrift_port", "queues.jobs.max_size",
                                                      "queues.jobs.max_items"], lines
    assert all(line.startswith("kestrel: bad configuration: ") for line in lines)


def kestrel_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))


def test_config_check_without_starting(tmp_path: Path) -> None:
    good = kestrel_command("config", "check", str(EXAMPLE))
    assert good.returncode == 0 and good.stdout.strip().endswith("kestrel.yaml: ok"), good.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("thrift_prot: 1\ndefault_queue:\n  sync_journal: often\naliases:\n  a: {targets: [q]}\n")
    done = kestrel_command("config", "check", str(bad))
    assert done.returncode == 2
    keys = [line.removeprefix("kestrel: bad configuration: ").split(":")[0] for line in done.stderr.splitlines()]
    assert keys == ["thrift_prot", "default_queue.sync_journal", "aliases.a.targets",
                    "aliases.a.destination_queues"], done.stderr
    # `serve --check` checks the command line's values too, and starts nothing.
    checked = kestrel_command("serve", "--check", "--config", str(EXAMPLE),
                              "--thrift-port=99999")
    assert checked.returncode == 2 and "--thrift-port: expected a port number" in checked.stderr
    # The options given before `serve` are its own (they were dropped: the defaults served).
    before = kestrel_command("--check", "--config", str(bad), "serve")
    assert before.returncode == 2 and "thrift_prot" in before.stderr, (before.stdout, before.stderr)
    before = kestrel_command("--config", str(EXAMPLE), "--thrift-port=99999", "serve", "--check")
    assert before.returncode == 2 and "--thrift-port: expected a port number" in before.stderr


def test_serve_help_has_a_description_defaults_and_exit_codes() -> None:
    done = kestrel_command("serve", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "Serve the queues" in text
    for default in ("(default: ./var/spool/kestrel)", "(default: 127.0.0.1)", "(default: 2229)",
                    "(default: 22133)", "(default: 2222)", "(default: 2223)", "(default: info)",
                    "(default: auto)"):
        assert default in text, default
    assert "--log-format {auto,json,console}" in text
    assert "exit codes:" in text
    for code in ("2 bad configuration", "3 damage that no one queue owns: the record of an interrupted",
                 "4 the queue path", "5 a listener", "6 out of file descriptors"):
        assert code in text, code
    # A queue whose own journal is damaged is refused alone while the server serves (exit 0 at its stop).
    assert "a queue whose own files are damaged is refused alone" in text
    assert "`kestrel config example` writes one" in text  # what the wheel ships, not a file of the clone


def test_config_example_writes_the_shipped_example(tmp_path: Path) -> None:
    shown = kestrel_command("config", "example")
    assert shown.returncode == 0 and shown.stdout == EXAMPLE.read_text()
    dashed = subprocess.run([sys.executable, "-m", "kestrel", "config", "example", "-"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert dashed.returncode == 0 and dashed.stdout == EXAMPLE.read_text()
    assert not (tmp_path / "-").exists()  # the usual name of standard output, not a file called "-"
    target = tmp_path / "kestrel.yaml"
    assert kestrel_command("config", "example", str(target)).returncode == 0
    assert target.read_text() == EXAMPLE.read_text()
    assert kestrel_command("config", "check", str(target)).returncode == 0
    target.write_text("# mine\n")
    again = kestrel_command("config", "example", str(target))
    assert again.returncode == 1 and "File exists" in again.stderr and target.read_text() == "# mine\n"


@pytest.mark.parametrize("log_format, is_json", [("json", True), ("console", False)])
def test_log_format(tmp_path: Path, log_format: str, is_json: bool) -> None:
    import json

    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kestrel", "serve", f"--log-format={log_format}",
                                 "--queue-path", str(tmp_path / "q"), *NO_LISTENERS[1:], f"--thrift-port={port}"],
                                stdout=out, stderr=out, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    try:
        from tests.conftest import wait_for

        wait_for(proc, lambda: STARTED in log.read_text(), "started")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    first = log.read_text().splitlines()[0]
    if is_json:
        assert json.loads(first)["event"] == "kestrel started"
    else:
        assert not first.startswith("{") and "kestrel started" in first and "\x1b[" not in first


def test_a_commit_log_damaged_inside_refuses_the_queue_it_names_alone(tmp_path: Path, server_factory: Any) -> None:
    from pymemcache.client.base import Client

    from kestrel.storage import commit_log

    path = tmp_path / "queues"
    folder = Path(commit_log.directory(str(path)))
    folder.mkdir(parents=True)
    (path / "q").write_bytes(b"")
    damaged = bytearray(commit_log.encode_record("q", 0, 0, b"first"))
    damaged[-1] ^= 1
    segment = folder / "1"
    segment.write_bytes(commit_log.MARK + bytes(damaged) + commit_log.encode_record("q", 0, 5, b"second"))
    srv = server_factory({"queue_path": str(path)})
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=10)
    with pytest.raises(Exception) as refused:
        mc.get("q")
    message = str(refused.value)
    assert f"corrupt journal {segment} at offset {len(commit_log.MARK)}" in message, message
    assert "checksum" in message and "--salvage" in message and "set aside the log" not in message
    mc.set("other", b"served")
    assert mc.get("other") == b"served"  # the other queues serve
    mc.close()
    assert (path / "q").read_bytes() == b""  # nothing applied

