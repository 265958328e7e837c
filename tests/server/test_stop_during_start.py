"""A stop asked for while the queues load ends the server at once, not after the replay, and the
next start loads every item: the real command, as a subprocess."""

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
    assert status == -sig, srv.log()[-2000:]  # ended by the signal, not after the replay with a clean stop
    assert STARTED not in srv.log() and "replayed journal" not in srv.log()

    srv.start()
    try:
        loaded = [json.loads(line) for line in srv.log().splitlines() if '"queue loaded"' in line]
        assert [(line["queue"], line["items"]) for line in loaded] == [("jobs", ITEMS)]
    finally:
        assert srv.stop() == 0
