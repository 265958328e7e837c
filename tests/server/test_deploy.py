"""deploy/: the systemd unit, the example config, and the sysusers.d and tmpfiles.d entries that create
the user the unit runs as and the queue path the config names. They must agree with each other, and
systemd's own tools must accept them."""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kestrel.service.config import EXAMPLE
from tests.conftest import PACKAGE_ROOT, ROOT, ServerProcess
from tests.support.system import tool

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "kestrel.service"
CONFIG = EXAMPLE  # `kestrel config example`
SYSUSERS = DEPLOY / "kestrel.sysusers.conf"
TMPFILES = DEPLOY / "kestrel.tmpfiles.conf"


def unit(path: Path = UNIT) -> dict[str, dict[str, str]]:
    """The unit's sections and keys, as systemd reads them: a repeated key adds to its value."""
    sections: dict[str, dict[str, str]] = {}
    section: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section[key] = f"{section[key]} {value}" if key in section else value
    return sections


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
    # The status file lives where the server may write (src/kestrel/service/startup.py checks it at start):
    # in the queue path's own directory, which the server makes.
    status = str(config["status_file"]).replace("{queue_path}", queue_path)
    assert os.path.dirname(status) == os.path.join(queue_path, ".kestrel")

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
    analyze = tool("systemd-analyze")
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


def exposure(analyze: str, unit_file: Path | str) -> float:
    """`systemd-analyze security`'s overall exposure of a unit file (0 safest, 10 least safe)."""
    done = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(unit_file)],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    return float(found.group(1))


def test_the_unit_is_hardened_at_least_as_debian_hardens_redis() -> None:
    analyze = tool("systemd-analyze")
    redis = tool("redis-server.service")  # Debian's redis-server unit, measured the same way
    ours, theirs = exposure(analyze, UNIT), exposure(analyze, redis)
    assert ours <= theirs, f"kestrel.service {ours} against redis-server.service {theirs}"
    # Writes only where the queues are, as the config names them.
    service = unit()["Service"]
    assert service["ReadWritePaths"].split() == [yaml.safe_load(CONFIG.read_text())["queue_path"]]
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "true"


def test_the_exposure_the_readmes_give_is_the_one_systemd_analyze_rates() -> None:
    """The README and bench/README.md give the unit's and Debian's Redis unit's figures as systemd 252
    rates them: they said 1.1 for a unit that rated 1.2 once its filter allowed sched_setaffinity."""
    analyze = tool("systemd-analyze")
    version = subprocess.run([analyze, "--version"], capture_output=True, text=True, timeout=60).stdout
    if not version.startswith("systemd 252 "):
        pytest.skip(f"the figures are systemd 252's, not {version.splitlines()[0]!r}'s")
    ours, theirs = exposure(analyze, UNIT), exposure(analyze, tool("redis-server.service"))
    readme = " ".join((ROOT / "README.md").read_text().split())
    claim = re.search(r"`systemd-analyze security kestrel\.service` rates it (\d\.\d)(, as Debian's Redis unit"
                      r"|, Debian's Redis unit (\d\.\d))", readme)
    assert claim is not None, "the README's figure"
    assert float(claim.group(1)) == ours and float(claim.group(3) or claim.group(1)) == theirs
    bench = (ROOT / "bench" / "README.md").read_text()
    rows = dict(re.findall(r"^\| (`deploy/kestrel\.service`|Debian's `redis-server\.service`[^|]*) \| (\d\.\d) ",
                           bench, re.MULTILINE))
    assert float(rows["`deploy/kestrel.service`"]) == ours
    assert [float(v) for k, v in rows.items() if k.startswith("Debian's")] == [theirs]


PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


def deny_write_execute() -> None:
    """What the unit's MemoryDenyWriteExecute enforces, for this process and what it executes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MDWE)")


def test_the_server_serves_where_no_memory_is_writable_and_executable(tmp_path: Path) -> None:
    """The unit's MemoryDenyWriteExecute, set here with prctl(PR_SET_MDWE) (Linux 6.3 and later), which
    a process keeps through exec: the server, its C helpers, gevent and the fsync threads all start."""
    probe = subprocess.run([sys.executable, "-c", "from tests.server.test_deploy import deny_write_execute as d; d()"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this kernel cannot deny memory both writable and executable (PR_SET_MDWE): {probe.stderr}")
    srv = ServerProcess(tmp_path, {"default_queue": {"sync_journal": "always"}})
    srv.child_setup = deny_write_execute
    srv.start()
    try:
        from pymemcache.client.base import Client

        client = Client(("127.0.0.1", srv.memcache_port))
        try:
            assert client.set("sealed", b"item") and client.get("sealed") == b"item"
        finally:
            client.close()
        assert srv.stop() == 0
    finally:
        srv.stop()
    assert "Traceback" not in srv.log(), srv.log()


def test_sysusers_and_tmpfiles_create_the_user_and_its_queue_path(tmp_path: Path) -> None:
    sysusers = tool("systemd-sysusers", "systemd")
    tmpfiles = tool("systemd-tmpfiles", "systemd")
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


def test_the_unit_s_system_call_filter_lets_the_fsync_rounds_take_their_cpu() -> None:
    """The filter's lines, applied in order as systemd applies them (an allow-list, then `~` lines
    taking from it, then lines adding to it): sched_setaffinity, which pins the fsync rounds to the
    disk's CPU (README, Performance), is in @resources, which the unit denies."""
    analyze = tool("systemd-analyze")

    def calls(names: list[str]) -> set[str]:
        found: set[str] = set()
        for name in names:
            if not name.startswith("@"):
                found.add(name)
                continue
            listed = subprocess.run([analyze, "syscall-filter", name], capture_output=True, text=True, timeout=60)
            assert listed.returncode == 0, listed.stderr
            found |= {line.strip() for line in listed.stdout.splitlines()[1:]
                      if line.startswith("    ") and not line.strip().startswith(("#", "@"))}
            found |= calls([line.strip() for line in listed.stdout.splitlines()[1:]
                            if line.strip().startswith("@")])
        return found

    lines = [line.partition("=")[2].split() for line in UNIT.read_text().splitlines()
             if line.startswith("SystemCallFilter=")]
    assert "sched_setaffinity" in calls(["@resources"])
    allowed: set[str] = set()
    for n, names in enumerate(lines):
        if names[0].startswith("~"):
            allowed -= calls([names[0][1:], *names[1:]])
        elif n == 0:
            allowed = calls(names)
        else:
            allowed |= calls(names)
    assert "sched_setaffinity" in allowed and "fdatasync" in allowed and "reboot" not in allowed
