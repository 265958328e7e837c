"""The machine's set-up for the suite: the Debian packages some tests need, two tools taken out of
Debian packages, and the small file systems the full-disk tests fill.

`make test` runs this file as a script before pytest (`python tests/support/system.py`); no test
installs or mounts anything. As root on Debian it installs what is missing, and does nothing when
everything is there already (a look at PATH and /proc/mounts). Without root or apt-get it says
what it could not do, and the tests that need it skip, naming it (`tool`, `small_disk`).

promtool and Redis's systemd unit are extracted from their packages (`apt-get download`, which needs
no root) instead of installed: installing `prometheus` or `redis-server` would start their daemons
where no policy forbids it.

The script uses the standard library only; the tests import `tool` and `small_disks` from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Each Debian package the tests use, and the command or file that shows it is installed.
PACKAGES = {
    "thrift-compiler": "thrift",            # Apache Thrift's generated Python client
    "libmemcached-tools": "memccat",        # libmemcached's command-line clients
    "default-jre-headless": "java",         # Spark and ZooKeeper
    "zookeeper": "/usr/share/java/zookeeper.jar",
    "gcc": "gcc",                           # bench/loadgen.c, the C helpers
    "libc6-dev": "/usr/include/stdio.h",
    "zlib1g-dev": "/usr/include/zlib.h",    # the commit log record's helper (src/kestrel/storage/_log_record.c)
    "systemd": "systemd-analyze",           # verify and security of deploy/kestrel.service
    "chromium": "chromium",                 # pages of the admin port, in a browser
    "chromium-driver": "chromedriver",
    "gdb": "gdb",                           # the C stacks of a test process that crashed (crash_report.py)
}
# Files taken out of a package without installing it: name -> (package, path inside it).
EXTRACTED = {
    "promtool": ("prometheus", "usr/bin/promtool"),
    "redis-server.service": ("redis-server", "lib/systemd/system/redis-server.service"),
}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kestrel-tests"

# Small tmpfs file systems for the full-disk tests (tests/end_to_end/test_disk_full.py), one per
# test running at once; a test holds one with a lock file beside it.
DISKS = Path(tempfile.gettempdir()) / "kestrel-test-disks"
DISK_COUNT = 4
DISK_SIZE = "2m"

DPKG_LOCK_WAIT_S = 600


def say(message: str) -> None:
    print(f"test set-up: {message}", file=sys.stderr)


def present(probe: str) -> bool:
    return os.path.exists(probe) if probe.startswith("/") else shutil.which(probe) is not None


def why_not_install() -> str | None:
    """Why apt-get cannot be used here, or None if it can."""
    if shutil.which("apt-get") is None:
        return "no apt-get (not Debian)"
    if os.geteuid() != 0:
        return "not root"
    return None


def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", "-o", f"DPkg::Lock::Timeout={DPKG_LOCK_WAIT_S}", *args], env=env,
                          capture_output=True, text=True, timeout=DPKG_LOCK_WAIT_S + 900)


def install_packages() -> None:
    missing = [package for package, probe in PACKAGES.items() if not present(probe)]
    if not missing:
        return
    reason = why_not_install()
    if reason is not None:
        say(f"cannot install {' '.join(missing)} ({reason}); the tests that need them will skip")
        return
    say(f"installing {' '.join(missing)}")
    done = apt_get("install", "-y", "-qq", *missing)
    if done.returncode != 0:  # a clean machine has no package lists, an old one stale lists
        apt_get("update", "-qq")
        done = apt_get("install", "-y", "-qq", *missing)
    if done.returncode != 0:
        say(f"apt-get install failed; the tests that need them will skip:\n{done.stderr.strip()}")


def extract_files() -> None:
    for name, (package, member) in EXTRACTED.items():
        target = CACHE / name
        if target.exists():
            continue
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            say(f"cannot extract {name} from {package} (not Debian); the tests that need it will skip")
            continue
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as work:
            done = subprocess.run(["apt-get", "download", "-qq", package], cwd=work, capture_output=True,
                                  text=True, timeout=600)
            if done.returncode != 0 and why_not_install() is None:
                apt_get("update", "-qq")
                done = subprocess.run(["apt-get", "download", "-qq", package], cwd=work, capture_output=True,
                                      text=True, timeout=600)
            debs = sorted(Path(work).glob("*.deb"))
            if done.returncode != 0 or not debs:
                say(f"cannot download {package} for {name}; the tests that need it will skip: "
                    f"{done.stderr.strip()}")
                continue
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(Path(work) / "x")], check=True, timeout=300)
            partial = target.with_name(target.name + ".partial")
            shutil.copy2(Path(work) / "x" / member, partial)
            partial.rename(target)


def mounted(path: Path) -> bool:
    with open("/proc/mounts", encoding="utf-8") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


def mount_disks() -> None:
    wanted = [DISKS / str(n) for n in range(DISK_COUNT)]
    if all(mounted(disk) for disk in wanted):
        return
    if os.geteuid() != 0 or shutil.which("mount") is None:
        say(f"cannot mount small file systems under {DISKS} (not root); the full-disk tests will skip")
        return
    for disk in wanted:
        if mounted(disk):
            continue
        disk.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(disk)],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            say(f"cannot mount a tmpfs on {disk}; the full-disk tests will skip: {done.stderr.strip()}")
            return


# ---------------------------------------------------------------------------------------------
# For the tests


def setup_hint() -> str:
    return "`make test` sets it up as root on Debian (tests/support/system.py)"


def tool(name: str, package: str | None = None) -> str:
    """The path of a command (of `package`, when it is not the command that tells the package is
    installed) or of an extracted file; skips the test, saying why, if it is missing."""
    import pytest

    if name in EXTRACTED:
        path = CACHE / name
        if path.exists():
            return str(path)
        package = EXTRACTED[name][0]
    else:
        found = shutil.which(name)
        if found:
            return found
        package = package or next(p for p, probe in PACKAGES.items() if probe == name)
    pytest.skip(f"{name} is missing (Debian's {package} package): {setup_hint()}")


def need_java() -> None:
    """Skip the test, saying why, where no Java runtime is installed (nor JAVA_HOME set)."""
    if not os.environ.get("JAVA_HOME"):
        tool("java")


def small_disks() -> list[Path]:
    """The small file systems mounted by the set-up (none without root)."""
    return [DISKS / str(n) for n in range(DISK_COUNT) if mounted(DISKS / str(n))]


def main() -> int:
    install_packages()
    extract_files()
    mount_disks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
