"""The servers a benchmark measures, each started on free loopback ports and stopped afterwards.

Our server runs from this checkout (`python -m kestrel serve`), in either build of its one source
(src/kestrel/build.py): `pure`, the Python source in src/, or `compiled`, the request path compiled
by mypyc in build/compiled (`make compiled` makes it). The peers come from Debian and are installed
with apt-get when the script runs as root, or named in a clear message otherwise; the one peer of
ours, bench/minimal_gevent_server.py, runs on this interpreter. Every server keeps its data under
the benchmark's work directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port, wait_port

ROOT = Path(__file__).resolve().parent.parent
# The source tree our server runs from: this checkout's, or another's (a benchmark's `--source`,
# to measure the code before a change beside the code after, in one run of this script).
SOURCE = ROOT / "src"
# Our server's builds: `pure` runs SOURCE, `compiled` COMPILED: this checkout's compiled build, or
# another's (a benchmark's `--compiled`, the code before a change).
BUILDS = ("compiled", "pure")
OWN_COMPILED = ROOT / "build" / "compiled"
COMPILED = OWN_COMPILED


class MissingPeer(Exception):
    """Raised when a peer server is not installed and cannot be installed from here, or a build of
    ours is not there or older than its source."""


def build_path(build: str) -> Path:
    """Where our server's `build` is imported from, checked to hold that build and, compiled, to be
    made from the source as it is (else the figures would be of older code: `make -q` asks the
    Makefile, which keys the compiled build by the source's hash; another tree's build is taken as
    it is)."""
    path = COMPILED if build == "compiled" else SOURCE
    if (build == "compiled" and path == OWN_COMPILED
            and subprocess.run(["make", "-q", "compiled"], cwd=ROOT).returncode != 0):
        raise MissingPeer(f"{path} is missing or older than the source: run `make compiled` first")
    probe = "from kestrel.build import build_name; print(build_name())"
    found = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=str(path)),
                           capture_output=True, text=True, check=True).stdout.strip()
    if found != build:
        raise MissingPeer(f"{path} holds the {found} build, not the {build} one")
    return path


def ensure_command(command: str, package: str) -> str:
    """The path of `command`, installing Debian's `package` first when running as root."""
    found = shutil.which(command)
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], env=env, capture_output=True)
        found = shutil.which(command)
    if found is None:
        raise MissingPeer(f"{command} is not installed: run `apt-get install {package}` as root "
                          f"(or run this benchmark as root to have it installed)")
    return found


@dataclass(frozen=True)
class Running:
    """A started server: its process id, the ports it listens on, and the directory it keeps data in."""

    pid: int
    ports: dict[str, int]
    home: Path

    def __getitem__(self, name: str) -> int:
        return self.ports[name]


@contextlib.contextmanager
def started(args: list[str], ports: dict[str, int], home: Path,
            env: dict[str, str] | None = None) -> Iterator[Running]:
    """`args` started and listening on `ports`; its output kept in `home` to say why it did not."""
    output = home / f"{Path(args[0]).name}-{min(ports.values())}.log"
    with open(output, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def gone() -> str | None:
        if proc.poll() is None:
            return None
        said = output.read_text(errors="replace").strip().splitlines()[-5:]
        return f"{Path(args[0]).name} exited with status {proc.returncode}: {' / '.join(said)}"

    try:
        for port in ports.values():
            wait_port(port, alive=gone)
        yield Running(proc.pid, ports, home)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def kestrel(work: Path, sync: str = "never", commit_log: str = "on", admin: bool = False,
            prepare: Callable[[Path], None] | None = None, build: str = "pure",
            source: Path | None = None, settings: dict[str, str] | None = None,
            queue: dict[str, str] | None = None) -> Iterator[Running]:
    """This checkout's server in `build` (or the build or source tree at `source`, another version
    of the code to compare with) with the Thrift and memcache ports open (and the admin port with
    `admin`), `sync_journal: sync` and `commit_log`, any other top-level `settings` of its config
    and `default_queue` settings of `queue`; `prepare` fills its queue path before it starts."""
    path = build_path(build) if source is None else source.resolve()
    ports = {"thrift": free_port(), "memcache": free_port()}
    if admin:
        ports["admin"] = free_port()
    home = Path(work) / f"kestrel-{build}-{sync}-{ports['thrift']}"
    home.mkdir(parents=True)
    if prepare is not None:
        (home / "queues").mkdir()
        prepare(home / "queues")
    config = home / "kestrel.yaml"
    config.write_text(f"queue_path: {home / 'queues'}\nlisten_address: 127.0.0.1\n"
                      f"thrift_port: {ports['thrift']}\nmemcache_port: {ports['memcache']}\n"
                      f"text_port: 0\nadmin_port: {ports.get('admin', 0)}\ncommit_log: {commit_log}\n"
                      + "".join(f"{key}: {value}\n" for key, value in (settings or {}).items())
                      + f"default_queue:\n  sync_journal: {sync}\n"
                      + "".join(f"  {key}: {value}\n" for key, value in (queue or {}).items()))
    env = dict(os.environ, PYTHONPATH=str(path))
    command = [sys.executable, "-m", "kestrel", "serve", "--config", str(config), "--log-level", "warning"]
    with started(command, ports, home, env) as running:
        yield running


@contextlib.contextmanager
def beanstalkd(work: Path, fsync: str = "never") -> Iterator[Running]:
    """beanstalkd with its binlog on: `never` is -F (no fsync), `always` is -f0 (fsync every write)."""
    port = free_port()
    binlog = Path(work) / f"beanstalkd-{port}"
    binlog.mkdir(parents=True)
    flags = ["-F"] if fsync == "never" else ["-f0"]
    with started([ensure_command("beanstalkd", "beanstalkd"), "-l", "127.0.0.1", "-p", str(port),
                  "-b", str(binlog), *flags], {"beanstalk": port}, binlog) as running:
        yield running


@contextlib.contextmanager
def redis(work: Path, fsync: str = "never") -> Iterator[Running]:
    """redis-server with its append-only file on: `never` is appendfsync no, `always` appendfsync always."""
    port = free_port()
    policy = {"never": "no", "always": "always"}[fsync]
    home = Path(work) / f"redis-{port}"
    home.mkdir(parents=True)
    with started([ensure_command("redis-server", "redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                  "--appendonly", "yes", "--appendfsync", policy, "--save", "", "--dir", str(home)],
                 {"redis": port}, home) as running:
        yield running


@contextlib.contextmanager
def memcached(work: Path) -> Iterator[Running]:
    """memcached on TCP only: the ceiling of the memcache workload (the same requests, no queue)."""
    port = free_port()
    user = ["-u", "root"] if os.geteuid() == 0 else []
    with started([ensure_command("memcached", "memcached"), "-l", "127.0.0.1", "-p", str(port), "-U", "0",
                  *user], {"memcache": port}, Path(work)) as running:
        yield running


@contextlib.contextmanager
def minimal_gevent(work: Path) -> Iterator[Running]:
    """bench/minimal_gevent_server.py: a memcache queue server with a greenlet per connection and
    no journal, the floor of what Python and gevent cost an item (the memcache workload)."""
    port = free_port()
    with started([sys.executable, "-m", "bench.minimal_gevent_server", str(port)], {"memcache": port},
                 Path(work), env=dict(os.environ, PYTHONPATH=str(ROOT))) as running:
        yield running
