"""deploy/: the systemd unit, the example config, and the sysusers.d and tmpfiles.d entries that create
the user the unit runs as and the queue path the config names. They must agree with each other, and
systemd's own tools must accept them."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import PACKAGE_ROOT, ROOT
from tests.support.installs import ensure_debian_package

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "kestrel.service"
CONFIG = DEPLOY / "kestrel.yaml"
SYSUSERS = DEPLOY / "kestrel.sysusers.conf"
TMPFILES = DEPLOY / "kestrel.tmpfiles.conf"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def entries(path: Path) -> list[list[str]]:
    """The lines of a sysusers.d or tmpfiles.d file, split as systemd splits them (quotes kept together)."""
    return [shlex.split(line) for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_unit_config_sysusers_and_tmpfiles_agree() -> None:
    service = unit()["Service"]
    config = yaml.safe_load(CONFIG.read_text())
    user, group = service["User"], service["Group"]

    # The user and group the unit runs as are created by the sysusers.d entry.
    users = {e[1]: e for e in entries(SYSUSERS) if e[0] == "u"}
    assert user in users, f"sysusers.d creates no user {user!r}"
    assert group == user, "a `u` line creates a group of the user's name only"

    # The queue path is created, owned by that user, by tmpfiles.d or by the unit's StateDirectory.
    created = {e[1]: e for e in entries(TMPFILES) if e[0] in ("d", "D")}
    state = ["/var/lib/" + d for d in service.get("StateDirectory", "").split()]
    queue_path = config["queue_path"]
    assert queue_path in created or queue_path in state, f"nothing creates queue_path {queue_path}"
    if queue_path in created:
        _type, _path, mode, owner, owner_group, *_ = created[queue_path]
        assert (owner, owner_group) == (user, group), "the queue path must belong to the server's user"
        assert int(mode, 8) & 0o700 == 0o700
    for directory in state:  # no directory made that nothing uses
        assert directory == queue_path, f"StateDirectory {directory} is not the config's queue_path"
    # The status file lives where the server may write (src/kestrel/service/startup.py checks it at start).
    status = str(config["status_file"]).replace("{queue_path}", queue_path)
    assert os.path.dirname(status) == queue_path

    # The unit runs the installed command on the config the README installs, with arguments it takes.
    exec_start = shlex.split(service["ExecStart"])
    assert exec_start[:2] == ["/opt/kestrel/bin/kestrel", "serve"]
    config_path = exec_start[exec_start.index("--config") + 1]
    assert Path(config_path).name == CONFIG.name
    args = [str(CONFIG) if a == config_path else a for a in exec_start[2:]]
    checked = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--check", *args], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert checked.returncode == 0, checked.stderr

    # An unprivileged user binds no port below 1024 unless the unit grants the capability.
    ports = [config[k] for k in ("thrift_port", "memcache_port", "text_port", "admin_port") if config[k]]
    assert len(set(ports)) == len(ports), ports
    if "CAP_NET_BIND_SERVICE" not in service.get("AmbientCapabilities", ""):
        assert all(port >= 1024 for port in ports), ports

    # Restarting cannot fix a bad configuration or a damaged journal (src/kestrel/service/startup.py's codes).
    from kestrel.service.startup import EXIT_CONFIG, EXIT_DAMAGED_JOURNAL

    assert {EXIT_CONFIG, EXIT_DAMAGED_JOURNAL} <= {int(c) for c in service["RestartPreventExitStatus"].split()}


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = ensure_debian_package("systemd-analyze", "systemd")
    if analyze is None:
        pytest.skip("systemd-analyze is missing and cannot be installed here (needs root and apt-get)")
    # verify checks that ExecStart's program exists: the unit as installed, but run from a stand-in.
    stand_in = tmp_path / "opt" / "kestrel" / "bin" / "kestrel"
    stand_in.parent.mkdir(parents=True)
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    copy = tmp_path / "kestrel.service"
    copy.write_text(UNIT.read_text().replace("/opt/kestrel/bin/kestrel", str(stand_in)))
    done = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=120)
    output = [line for line in (done.stdout + done.stderr).splitlines() if "kestrel.service" in line]
    assert done.returncode == 0 and not output, done.stdout + done.stderr


def test_sysusers_and_tmpfiles_create_the_user_and_its_queue_path(tmp_path: Path) -> None:
    sysusers = ensure_debian_package("systemd-sysusers", "systemd")
    tmpfiles = ensure_debian_package("systemd-tmpfiles", "systemd")
    if sysusers is None or tmpfiles is None:
        pytest.skip("systemd-sysusers or systemd-tmpfiles is missing and cannot be installed here")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles gives the queue path to the server's user only as root")
    root = tmp_path / "root"
    (root / "etc" / "sysusers.d").mkdir(parents=True)
    (root / "etc" / "tmpfiles.d").mkdir(parents=True)
    shutil.copy(SYSUSERS, root / "etc" / "sysusers.d" / "kestrel.conf")
    shutil.copy(TMPFILES, root / "etc" / "tmpfiles.d" / "kestrel.conf")
    for command in ([sysusers, f"--root={root}"], [tmpfiles, f"--root={root}", "--create"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    service = unit()["Service"]
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()}
    uid, gid = int(passwd[service["User"]][2]), int(passwd[service["User"]][3])
    queue_path = root / yaml.safe_load(CONFIG.read_text())["queue_path"].lstrip("/")
    made = queue_path.stat()
    assert (made.st_uid, made.st_gid) == (uid, gid) and queue_path.is_dir()
