"""Shared fixtures: the real server as a subprocess on free ports."""

from __future__ import annotations

import compileall
import fcntl
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import kestrel

ROOT = Path(__file__).resolve().parent.parent
# Where the build under test is imported from: src/ (the editable install, the pure build), or the
# compiled build's folder when PYTHONPATH puts it first (`make test`: build/compiled). The servers
# and commands the tests start run that build too.
PACKAGE_ROOT = Path(kestrel.__file__).resolve().parent.parent
STARTED = "kestrel started"  # the server's log line once every listener is bound
OPEN_FILES_WANTED = 65_536  # the test processes' soft limit of descriptors, where the hard one allows


def open_files_within(limit: int) -> int:
    """`OPEN_FILES_WANTED`, or fewer descriptors where `limit` (RLIMIT_NOFILE's) is lower."""
    return OPEN_FILES_WANTED if limit == resource.RLIM_INFINITY else min(limit, OPEN_FILES_WANTED)


def pytest_configure(config: pytest.Config) -> None:
    from tests.support.scheduling import Scheduler

    config.pluginmanager.register(Scheduler(config), "kestrel-scheduling")
    # A long run's worker holds some hundreds of files its tests leave open (a crash model's
    # collections, a test's journals): near the usual soft limit of 1,024 descriptors, where a
    # clean machine would fail later tests with EMFILE. The hard limit is the machine's bound.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = open_files_within(hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    # pytest keeps the test modules' rewritten asserts like compiled modules, unless told not to write
    # bytecode (PYTHONDONTWRITEBYTECODE): then every test process rewrites every test module again,
    # 3 s of CPU each. __pycache__ is ignored by git.
    sys.dont_write_bytecode = False
    if getattr(config, "workerinput", None) is None:
        compile_project()


# A test that replaces a function or method of a compiled module (to count its calls or to fail it)
# sees nothing in the compiled build, whose callers call it directly: `pure_build` marks it, and it runs
# on the pure build only (`make test` runs its folder there too: PURE_TESTS in the Makefile).
PURE_BUILD_ONLY = "replaces code the compiled build calls directly: runs on the pure build"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from kestrel.build import build_name

    if build_name() != "pure":
        for item in items:
            if item.get_closest_marker("pure_build") is not None:
                item.add_marker(pytest.mark.skip(reason=PURE_BUILD_ONLY))


def compile_project() -> None:
    """Every server and command a test starts imports the project anew, and under
    PYTHONDONTWRITEBYTECODE nothing keeps their compiled code: compiling it took a third of a
    server's start. Compiled once here (a no-op while up to date; a changed source is compiled again)."""
    compileall.compile_dir(PACKAGE_ROOT, quiet=1)


# Ports for test servers. Ports the kernel hands out (to bind(0), and to every connect() on the machine)
# come from the ephemeral range, so a port picked there can be taken by any process while its server is
# down between a kill and a restart, and the restart then fails with "Address already in use" (seen with
# two suites on one machine). So test ports come from just below the ephemeral range, which the kernel
# never hands out, and each test process takes a block of them of its own, with a lock file held for
# its life: concurrent test processes (xdist workers, other checkouts' suites, benchmarks) never pick
# the same port. Within a process, ports a live ServerProcess holds are never handed out again.
PORT_BLOCK = 400
PORT_BLOCKS_DIR = Path(tempfile.gettempdir()) / "kestrel-test-ports"


class _PortBlock:
    def __init__(self) -> None:
        self.ports: range | None = None
        self.next = 0
        self.held: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._lock_fd = -1
        self._lock = threading.Lock()

    def _claim(self) -> range | None:
        """A block of ports below the ephemeral range that no other process holds; None if there is no
        room (a system whose ephemeral range starts low)."""
        try:
            low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768
        first = max(10_000, low - 30 * PORT_BLOCK)
        PORT_BLOCKS_DIR.mkdir(exist_ok=True)
        for start in range(first, low - PORT_BLOCK + 1, PORT_BLOCK):
            fd = os.open(PORT_BLOCKS_DIR / f"{start}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd = fd  # held until this process exits
            return range(start, start + PORT_BLOCK)
        return None

    def take(self, count: int, owner: object | None) -> list[int] | None:
        with self._lock:
            if self.ports is None:
                self.ports = self._claim()
                if self.ports is None:
                    return None
            picked: list[int] = []
            held: list[socket.socket] = []
            try:
                for _ in range(len(self.ports)):
                    port = self.ports[self.next]
                    self.next = (self.next + 1) % len(self.ports)
                    if port in self.held:
                        continue
                    s = socket.socket()
                    try:
                        s.bind(("127.0.0.1", port))  # no other program listens there, nor lingers
                    except OSError:
                        s.close()
                        continue
                    held.append(s)
                    picked.append(port)
                    if len(picked) == count:
                        break
            finally:
                for s in held:
                    s.close()
            if len(picked) < count:
                return None
            if owner is not None:
                for port in picked:
                    self.held[port] = owner
            return picked


_PORTS = _PortBlock()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int, owner: object | None = None) -> list[int]:
    """`count` different ports free now, from this process's own block (see PORT_BLOCK). With an
    `owner`, they are not handed out again while it lives, free or not (its server may be down for a
    restart). A port picked without an owner is one where nothing listens, for a while."""
    picked = _PORTS.take(count, owner)
    if picked is not None:
        return picked
    # No block: ports the kernel picks, held open together while picked (picked one after another, a
    # port just closed can come back at once).
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


# The upper bound a test puts on anything that should take a moment (a wake-up, a refusal, a stop, one
# round trip): seconds that a loaded machine does not reach, while a server that stalls, hangs or sits
# out a timeout it should not wait for does. How long these things take is a benchmark's figure
# (bench/bench_responsiveness.py, bench/fuzz_servers.py), not a test's.
STALL_S = 5.0


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> float:
    """Poll `check` until it holds; the seconds that took. AssertionError naming `what` after `timeout`.

    The timeout is a deadline for something that must happen, not a budget: generous, so that a loaded
    machine never meets it while a hung server or a lost wake-up still fails the test. The one sleep
    of the suite's polling; a test that must see real time pass says so beside its own."""
    started = time.monotonic()
    pause = 0.002
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return time.monotonic() - started


def wait_for(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `ready` until true; RuntimeError naming `what` if the server exits first or time runs out."""

    def ready_or_gone() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {what}")
        return ready()

    try:
        wait_until(ready_or_gone, what, timeout)
    except AssertionError:
        raise RuntimeError(f"server not {what} within {timeout}s") from None


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    wait_for(proc, answers, f"listening on {port}", timeout)


class ServerProcess:
    """`python -m kestrel serve` with its own queue path, config file and free ports."""

    def __init__(self, workdir: Path, config: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.queue_path = workdir / "queues"
        self.config_path = workdir / "kestrel.yaml"
        self.log_path = workdir / "server.log"
        self.thrift_port, self.memcache_port, self.text_port, self.admin_port = free_ports(4, owner=self)
        self.config: dict[str, Any] = {
            "queue_path": str(self.queue_path),
            "listen_address": "127.0.0.1",
            "thrift_port": self.thrift_port,
            "memcache_port": self.memcache_port,
            "text_port": self.text_port,
            "admin_port": self.admin_port,
        }
        self.config.update(config or {})
        self.open_files_limit: int | None = None  # RLIMIT_NOFILE for the server process
        self.child_setup: Callable[[], None] | None = None  # run in the server's process before exec
        self.python_path: list[str] = []  # put before the project on the server's PYTHONPATH
        self.wrapper: list[str] = []  # a command the server runs under (e.g. setpriv)
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _module_exists(key: str) -> bool:
        name = key.removesuffix("_port")
        service = ROOT / "src" / "kestrel" / "service"
        return (service / name).is_dir() or (service / f"{name}.py").exists()

    def start(self) -> ServerProcess:
        """Start the server and wait until it is serving. On a first start, a port picked as free that
        another process took meanwhile (other test runs share the machine) is picked again."""
        first = self.proc is None
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError:
                if not first or attempt == 2 or "Address already in use" not in self.log():
                    raise
                self.stop()
                self._pick_ports_again()
        raise AssertionError("unreachable")

    def _pick_ports_again(self) -> None:
        ports = iter(free_ports(4, owner=self))
        for key in ("thrift_port", "memcache_port", "text_port", "admin_port"):
            if self.config.get(key) == getattr(self, key):  # only the ports chosen here, not a test's
                port = next(ports)
                setattr(self, key, port)
                self.config[key] = port

    def _start(self) -> ServerProcess:
        for key in ("thrift_port", "memcache_port", "text_port", "admin_port"):
            if not self._module_exists(key):
                self.config[key] = 0
        self.config_path.write_text(yaml.safe_dump(self.config))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*self.python_path, str(PACKAGE_ROOT)]))
        command = [*self.wrapper, sys.executable, "-m", "kestrel", "serve", "--config", str(self.config_path)]
        starts = self.log().count(STARTED)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=str(self.workdir), stdout=log, stderr=log, env=env,
                                         preexec_fn=self._prepare_child)
        # Up once it says so, after binding every listener; a port answering may be another process's
        # (taken between picking it and the server's bind).
        try:
            wait_for(self.proc, lambda: self.log().count(STARTED) > starts, "started")
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log ends:\n{self.log()[-3000:]}") from None
        return self

    def _prepare_child(self) -> None:
        if self.open_files_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files_limit, self.open_files_limit))
        if self.child_setup is not None:
            self.child_setup()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def started_build(self) -> str:
        """The build (src/kestrel/build.py) the server said it runs when it last started."""
        started = [json.loads(line) for line in self.log().splitlines() if STARTED in line]
        return str(started[-1]["build"])


@pytest.fixture(autouse=True)
def _no_hub_leftovers() -> Iterator[None]:
    """Fail a test that leaves a timer of the engine on the gevent hub, and let the work it left off
    the loop finish before the next test (tests/support/hub_leftovers.py). Then close the
    collections the storage helpers opened and the test left open (tests/support/queues.py)."""
    from tests.support.hub_leftovers import let_background_work_finish, no_hub_leftovers
    from tests.support.queues import close_left_open

    try:
        with no_hub_leftovers():
            yield
    finally:
        let_background_work_finish()
        close_left_open()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Any]:
    """Start servers with extra YAML settings: `server_factory({"default_queue": {...}})`."""
    started: list[ServerProcess] = []

    def start(config: dict[str, Any] | None = None, name: str = "server") -> ServerProcess:
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        srv = ServerProcess(workdir, config).start()
        started.append(srv)
        return srv

    yield start
    running = [srv for srv in started if srv.proc is not None and srv.proc.poll() is None]
    for srv in running:  # all told at once: they stop side by side
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
    for srv in running:
        srv.stop()


@pytest.fixture
def server(server_factory: Any) -> ServerProcess:
    """One server on the defaults."""
    return server_factory()


@pytest.fixture
def server_state(tmp_path: Path) -> Iterator[Any]:
    """A server's state (collection, stats, config) in this process, on its own queue path, for
    connections served on a socket pair."""
    from kestrel.service.config import from_mapping
    from kestrel.service.session.server_state import ServerState

    state = ServerState(from_mapping({"queue_path": str(tmp_path)}, str(tmp_path)))
    state.collection.load()
    yield state
    state.close()


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One standalone ZooKeeper for the session; tests keep apart by using their own path prefix."""
    from tests.support.system import setup_hint
    from tests.support.zookeeper_server import ZooKeeperServer, zookeeper_classpath

    classpath = zookeeper_classpath()
    if classpath is None:
        pytest.skip(f"ZooKeeper needs Debian's zookeeper and default-jre-headless packages: {setup_hint()}")
    zk = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"), classpath).start()
    yield zk
    zk.stop()


@pytest.fixture
def zk(zookeeper: Any) -> Iterator[Any]:
    """A KazooClient of that ZooKeeper, started (a test may stop and start it again), for a test's own
    look at the sets or changes to them from outside; stopped and closed after the test."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=zookeeper.hosts, timeout=10)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


APACHE_GENERATED = "apache_kestrel"


@pytest.fixture(scope="session")
def apache_generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(the service module, the types module) Apache Thrift's own compiler generates from the
    contract, for PyPI's `thrift` library. The contract's Python namespace is `kestrel`, which this
    package's own namespace takes in this process: generated under another name (a namespace names
    modules only; the wire is the same)."""
    import importlib

    from kestrel.contract import IDL_PATH
    from tests.support.system import tool

    compiler = tool("thrift")
    out = tmp_path_factory.mktemp("gen-py")
    idl = out / "kestrel.thrift"
    idl.write_text(IDL_PATH.read_text().replace("namespace py kestrel", f"namespace py {APACHE_GENERATED}"))
    subprocess.run([compiler, "--gen", "py", "-out", str(out), str(idl)], check=True)
    sys.path.insert(0, str(out))
    try:
        yield (importlib.import_module(f"{APACHE_GENERATED}.Kestrel"),
               importlib.import_module(f"{APACHE_GENERATED}.ttypes"))
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m == APACHE_GENERATED or m.startswith(f"{APACHE_GENERATED}.")]:
            del sys.modules[name]
