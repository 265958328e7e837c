"""The README's steps from a clean machine to an enabled service (Operations: Install as a service),
run as written in a scratch root: absolute paths are moved under it, systemd's tools get `--root`,
and the unit's ExecStart runs as systemd would start it. This is also the only test of a
non-editable install (`pip install .`, or under `make test` the wheel it built of the same source),
which would miss a file the wheel lacks, such as the Thrift contract, the example config or the
admin page's files.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from kestrel.build import COMPILED_MODULES
from tests.conftest import PACKAGE_ROOT, ROOT, free_ports, wait_for_port
from tests.support.system import tool

# What the test does not run, and why; every other line of the steps runs.
NOT_RUN = {
    "apt-get": "Debian packages: the suite's Python already has venv",
    "systemctl daemon-reload": "no systemd runs here; an offline enable reads the unit from the root",
    "curl": "the test asks /ready itself",
}


def readme_steps() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- steps: install -->\n```sh\n(.*?)```", text, re.S)
    assert block is not None, "the README has no install steps"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def rooted(word: str, root: Path) -> str:
    """An absolute path of the steps, moved under `root`."""
    return str(root) + word if word.startswith(("/opt/", "/etc/", "/usr/lib/", "/var/")) else word


def test_every_installed_command_the_readme_says_to_run_is_one_the_cli_takes() -> None:
    """An inline `/opt/kestrel/bin/kestrel ...` of the README is a command to type as it stands: the
    command line parses it, required arguments and all (`config check` lacked its FILE). Parsed in a
    process of its own: importing the command line patches the process for gevent."""
    text = " ".join((ROOT / "README.md").read_text().split())
    commands = re.findall(r"`/opt/kestrel/bin/kestrel ([^`]*)`", text)
    assert any(c.startswith("config check") for c in commands), "the README says to check the config"
    parse = ("import shlex, sys\nfrom kestrel.service.cli import build_parser\n"
             "for command in sys.argv[1:]:\n    build_parser().parse_args(shlex.split(command))\n")
    for command in commands:
        done = subprocess.run([sys.executable, "-c", parse, command], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
        assert done.returncode == 0, f"the README's `kestrel {command}` is refused by the command line: {done.stderr}"


@pytest.mark.slow
# `pip install .` compiles the request path in a fresh build environment (`make test` hands over its
# wheel instead): run alone on a loaded machine that has taken more than ten minutes.
@pytest.mark.timeout(1800)
def test_the_readme_installs_an_enabled_service_that_serves(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the service's steps run as root (systemd-tmpfiles gives the queue path to its user)")
    sysusers = tool("systemd-sysusers", "systemd")
    tmpfiles = tool("systemd-tmpfiles", "systemd")
    systemctl = tool("systemctl", "systemd")
    root = tmp_path / "root"
    root.mkdir()
    clone = tmp_path / "clone"  # the clone the steps run in, without what a build leaves
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "var", "*.egg-info", "__pycache__", "spark-warehouse"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # `make test` hands over the wheel it built of this source (the step's own alternative), so
    # that one run compiles the request path once; run alone, the step builds it as written.
    wheel = os.environ.get("KESTREL_TEST_WHEEL", "")
    ran = []
    for line in readme_steps():
        words = [rooted(word, root) for word in shlex.split(line)]
        skipped = next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)
        if skipped:
            continue
        if words[1:] == ["install", "."] and wheel:
            words[-1] = wheel
        if words[:3] == ["python3", "-m", "venv"]:
            words[0] = sys.executable
        elif words[0] == "systemd-sysusers":
            words = [sysusers, f"--root={root}", *words[1:]]
        elif words[0] == "systemd-tmpfiles":
            words = [tmpfiles, f"--root={root}", *words[1:]]
        elif words[:2] == ["systemctl", "enable"]:  # --now: started below, as the unit says
            words = [systemctl, f"--root={root}", "enable", *[w for w in words[2:] if w != "--now"]]
        elif words[0] == "install" or words[0].startswith(str(root)):
            pass
        else:
            raise AssertionError(f"a step the test does not know how to run: {line}")
        done = subprocess.run(words, cwd=clone, env=env, capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        ran.append(line)
    assert len(ran) >= 8, ran

    # Installed: one namespace at the top of site-packages, the contract and the example in it.
    (site,) = (root / "opt" / "kestrel" / "lib").glob("python*/site-packages")
    (record,) = site.glob("kestrel_py-*.dist-info/RECORD")
    installed = [line.split(",")[0] for line in record.read_text().splitlines()]
    top = {name.split("/")[0] for name in installed
           if ".dist-info/" not in name and not name.startswith(("..", "__pycache__/"))}
    # The compiled request path's shared library (setup.py) is named after the package too.
    top = {name for name in top if not name.startswith("kestrel__mypyc.")}
    # Beside it, the modules Spark's lookup finds, and the start-up hook that lets spark.pyspark.python
    # name the Python of Spark's driver side (src/kestrel_pyspark_python.py) with its .pth.
    assert top == {"kestrel", "pyspark_kestrel.py", "pyspark_kestrel_journal.py", "kestrel_pyspark_python.py",
                   "kestrel-pyspark-python.pth"}, top
    assert {os.path.join("kestrel", "contract", "kestrel.thrift"),
            os.path.join("kestrel", "service", "kestrel.yaml")} <= set(installed)
    # The request path compiled from its source (mypyc is among the build's requirements), each
    # module beside that source; only without a C compiler does the build leave it pure.
    compiler = shutil.which("cc") or shutil.which("gcc")
    for module in COMPILED_MODULES if compiler else ():
        path = module.replace(".", "/")
        assert f"{path}.py" in installed, module
        assert any(name.startswith(f"{path}.") and name.endswith(".so") for name in installed), module
    static = ROOT / "src" / "kestrel" / "service" / "dashboard" / "static"
    page_files = {f"kestrel/service/dashboard/static/{p.relative_to(static)}" for p in static.rglob("*") if p.is_file()}
    assert page_files == {name for name in installed if "/dashboard/static/" in name}

    # Enabled: the unit is wanted by multi-user.target, as `enable` made it.
    wants = root / "etc" / "systemd" / "system" / "multi-user.target.wants" / "kestrel.service"
    assert wants.is_symlink() and os.readlink(wants).endswith("kestrel.service")
    # The user and the queue path.
    passwd = (root / "etc" / "passwd").read_text()
    assert re.search(r"^kestrel:x:\d+:\d+:", passwd, re.M), passwd
    spool = root / "var" / "spool" / "kestrel"
    assert spool.is_dir()

    # Started as the unit says, on the installed config (on free ports, as an operator would edit it).
    unit = (root / "etc" / "systemd" / "system" / "kestrel.service").read_text()
    exec_start = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))  # type: ignore[union-attr]
    config_path = Path(rooted(exec_start[exec_start.index("--config") + 1], root))
    config = yaml.safe_load(config_path.read_text())
    assert config["listen_address"] == "127.0.0.1" and config["queue_path"] == "/var/spool/kestrel"
    memcache, admin = free_ports(2)
    config.update(queue_path=str(spool), memcache_port=memcache, admin_port=admin, thrift_port=0, text_port=0)
    config_path.write_text(yaml.safe_dump(config))
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([rooted(word, root) for word in exec_start], cwd="/", env=env, stdout=out,
                                stderr=out)
    try:
        wait_for_port(admin, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b"Up\n"
        # The admin page and its charting library, from the installed package.
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/", timeout=10) as reply:
            assert b'<script src="/dashboard/dashboard.js"' in reply.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/dashboard/uplot/uPlot.iife.min.js", timeout=10) as reply:
            assert reply.read() == (static / "uplot" / "uPlot.iife.min.js").read_bytes()
        from pymemcache.client.base import Client

        client = Client(("127.0.0.1", memcache), timeout=10)
        try:
            assert client.set("installed", b"from the steps") and client.get("installed") == b"from the steps"
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0 and "Traceback" not in log.read_text(), log.read_text()
    started = [json.loads(line) for line in log.read_text().splitlines() if "kestrel started" in line]
    assert started[0]["build"] == ("compiled" if compiler else "pure")
