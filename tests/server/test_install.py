"""A non-editable install: build the wheel, install it into a fresh virtual environment, serve from it.

This is what an operator does (`pip install kestrel_py-*.whl`), and the only test that would notice a
file missing from the wheel, such as the Thrift contract.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from kestrel.build import COMPILED_MODULES
from kestrel.contract import kestrel_thrift
from tests.conftest import free_ports, wait_for_port
from tests.support.installs import build_wheel


def _run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_serves(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    # One namespace: nothing generic at the top of site-packages (a user's own `storage.py` or
    # `client.py` must not shadow ours, nor ours theirs); Spark finds its sources as top-level modules.
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist() if ".dist-info/" not in name}
    # The compiled request path's shared library (setup.py) is named after the package too.
    top = {name for name in top if not name.startswith("kestrel__mypyc.")}
    assert top == {"kestrel", "pyspark_kestrel.py", "pyspark_kestrel_journal.py"}, top
    # The request path compiled from its source (mypyc is among the build's requirements), each
    # module beside that source; without a C compiler the build leaves it pure.
    if shutil.which("cc") or shutil.which("gcc"):
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
        for module in COMPILED_MODULES:
            path = module.replace(".", "/")
            assert f"{path}.py" in names and any(name.startswith(f"{path}.") and name.endswith(".so")
                                                 for name in names), module
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    # The project's pip installs into the new environment (pip --python), from the same caches; the
    # installed modules are compiled when imported, not all of them (gevent's too) beforehand.
    _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet", "--no-compile",
         wheel, cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run(venv / "bin" / "python", "-c", "import kestrel.contract; print(kestrel.contract.IDL_PATH)", cwd=tmp_path,
                 env=env)
    assert Path(where.strip()).is_file() and Path(where.strip()).is_relative_to(venv), where

    thrift_port, memcache_port = free_ports(2)
    config = tmp_path / "kestrel.yaml"
    config.write_text(yaml.safe_dump({
        "queue_path": str(tmp_path / "queues"), "thrift_port": thrift_port, "memcache_port": memcache_port,
        "text_port": 0, "admin_port": 0}))
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "kestrel"), "serve", "--config", str(config)],
                                cwd=tmp_path, env=env, stdout=out, stderr=out)
    try:
        wait_for_port(thrift_port, proc)
        from thriftpy2.rpc import make_client
        from thriftpy2.transport import TFramedTransportFactory

        client = make_client(kestrel_thrift.Kestrel, "127.0.0.1", thrift_port,
                             trans_factory=TFramedTransportFactory(), timeout=5000)
        try:
            assert client.put("installed", [b"from the wheel"], 0) == 1
            assert [item.data for item in client.get("installed", 1, 0, 0)] == [b"from the wheel"]
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
    assert code == 0 and "Traceback" not in log.read_text(), log.read_text()
    started = [json.loads(line) for line in log.read_text().splitlines() if "kestrel started" in line]
    assert started[0]["build"] == ("compiled" if shutil.which("cc") or shutil.which("gcc") else "pure")
