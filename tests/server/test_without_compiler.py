"""The server as it runs where the wheel was built without a C compiler: the request path not
compiled (the pure build) and every C helper missing, the Python code each stands in for serving,
end to end over real sockets, through a restart, whichever build the suite itself runs.

The server runs the Python source (src/), with a `sitecustomize` on its path that makes importing
each helper fail, as it does when the build skipped it (setup.py: `optional=True`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pymemcache.client.base import Client as MemcacheClient
from thriftpy2.rpc import make_client
from thriftpy2.transport import TFramedTransportFactory

from kestrel.build import C_HELPERS
from kestrel.contract import kestrel_thrift as kestrel
from tests.conftest import ROOT, ServerProcess
from tests.support.lines import exchange


@pytest.fixture
def no_helpers(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {C_HELPERS!r}:\n"
        "    sys.modules[name] = None  # importing it raises ImportError, as after a build without them\n")
    return site


def test_the_python_fallbacks_are_what_such_a_process_uses(no_helpers: Path) -> None:
    probe = ("from kestrel.storage import item; from kestrel.storage.kestrel2 import codec; "
             "from kestrel.storage.fsync import group_commit; from kestrel.service.thrift import protocol as thrift_protocol; "
             "from kestrel.service.memcache import runs; from kestrel.storage import crc32c; "
             "from kestrel.service import socket_io; from kestrel.build import build_name; "
             "from kestrel.storage import commit_log; from kestrel.storage.kestrel3 import codec as k3; "
             "print(item.QItem is item.QItemPython, codec.decode_common is codec.decode_common_python, "
             "codec._encode_addx_many_c is None, thrift_protocol.compiled_binary is None, "
             "group_commit.native_threads() is None, runs.scan_sets is None, "
             "runs.scan_gets is None, runs.values is runs.values_python, crc32c.crc32c is crc32c.crc32c_python, "
             "socket_io.receive_in_place is None, build_name() == 'pure', "
             "commit_log._append_compiled is commit_log.append_record_python, k3._DECODE_PUTS_C is None)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(no_helpers), str(ROOT / "src")]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"] * 13


def test_a_server_without_its_helpers_serves_every_path_and_replays(tmp_path: Path, no_helpers: Path) -> None:
    workdir = tmp_path / "server"
    workdir.mkdir()
    srv = ServerProcess(workdir)
    srv.python_path = [str(no_helpers), str(ROOT / "src")]  # the source, whichever build the tests run
    srv.start()
    assert srv.started_build() == "pure"
    try:
        client = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=10_000,
                             trans_factory=TFramedTransportFactory())
        assert client.put("q", [b"one"], 0) == 1
        assert client.put("q", [b"item %d" % n for n in range(100)], 0) == 100
        assert [i.data for i in client.get("q", 1, 0, 0)] == [b"one"]
        opened = client.get("q", 10, 0, 60_000)
        assert [i.data for i in opened] == [b"item %d" % n for n in range(10)]
        assert client.confirm("q", {i.id for i in opened}) == 10
        client.close()
        mc = MemcacheClient(("127.0.0.1", srv.memcache_port))
        assert mc.set("m", b"by memcache")
        assert mc.get("m") == b"by memcache"
        mc.close()
        with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as raw:
            # Pipelined sets and gets, each parsed alone (no scanner finds runs).
            raw.sendall(b"set m 0 0 1\r\na\r\nset m 0 0 1 noreply\r\nb\r\n" + b"get m\r\n" * 3)
            assert exchange(raw, b"", b"END\r\nEND\r\n") == (
                b"STORED\r\nVALUE m 0 1\r\na\r\nEND\r\nVALUE m 0 1\r\nb\r\nEND\r\nEND\r\n")
        srv.restart()  # the journal replayed by the Python decoder
        client = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=10_000,
                             trans_factory=TFramedTransportFactory())
        assert [i.data for i in client.get("q", 100, 0, 0)] == [b"item %d" % n for n in range(10, 100)]
        client.close()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()
