"""A stop asked for while the queues load ends the server at once, not after the replay, and the
next start loads every item; a reload asked for before the server handles SIGHUP runs once it
does, where the signal's default action killed it: the real command, as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kestrel.storage.kestrel2 import codec
from tests.conftest import PACKAGE_ROOT, STARTED, ServerProcess, wait_for

ITEMS = 2_000_000  # a replay of a second or more, so the stop lands in it on any machine


def has_open(pid: int, path: Path) -> bool:
    """Whether process `pid` holds `path` open (it is replaying it)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == str(path) for fd in fds.iterdir())
    except OSError:  # a descriptor closed while listed
        return False


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler of `sig` (its SigCgt mask, /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def loading(srv: ServerProcess) -> subprocess.Popen[bytes]:
    """`kestrel serve` on `srv`'s settings, left to start on its own."""
    srv.config_path.write_text(yaml.safe_dump(srv.config))
    with open(srv.log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kestrel", "serve", "--config", str(srv.config_path)],
                                stdout=log, stderr=log, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_queues_load_ends_the_process_at_once_and_loses_nothing(tmp_path: Path,
                                                                                sig: signal.Signals) -> None:
    srv = ServerProcess(tmp_path)
    srv.queue_path.mkdir()
    (srv.queue_path / "jobs").write_bytes(codec.encode_addx(1_700_000_000_000, 0, b"x" * 16) * ITEMS)
    proc = loading(srv)
    try:
        wait_for(proc, lambda: has_open(proc.pid, srv.queue_path / "jobs"), "replaying the journal")
        proc.send_signal(sig)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 0, srv.log()[-2000:]  # a clean stop, at once: not after the replay
    assert f"kestrel: {sig.name} while starting: stopped at once" in srv.log()
    assert STARTED not in srv.log() and "replayed journal" not in srv.log()

    srv.start()
    try:
        loaded = [json.loads(line) for line in srv.log().splitlines() if '"queue loaded"' in line]
        assert [(line["queue"], line["items"]) for line in loaded] == [("jobs", ITEMS)]
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("when", ["as the command starts", "while the queues load"])
def test_a_reload_asked_for_before_the_server_takes_sighup_runs_once_it_has_started(tmp_path: Path,
                                                                                   when: str) -> None:
    """An init script's SIGHUP just after the start killed the server (exit 129, nothing logged)."""
    srv = ServerProcess(tmp_path, {"queues": {"jobs": {"max_items": 10}}})
    srv.queue_path.mkdir()
    (srv.queue_path / "jobs").write_bytes(codec.encode_addx(1_700_000_000_000, 0, b"x" * 16) * (ITEMS // 4))
    proc = loading(srv)
    try:
        if when == "while the queues load":
            wait_for(proc, lambda: has_open(proc.pid, srv.queue_path / "jobs"), "replaying the journal")
        else:  # once the command's first lines ran, before its imports and its config
            wait_for(proc, lambda: catches(proc.pid, signal.SIGHUP), "catching SIGHUP")
        proc.send_signal(signal.SIGHUP)
        wait_for(proc, lambda: "queue settings reloaded" in srv.log(), "the reload, once started", timeout=120)
        assert proc.poll() is None and STARTED in srv.log()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, srv.log()[-2000:]
