"""A real standalone ZooKeeper (Debian's `zookeeper` package) on a free port, for the cluster tests."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from tests.conftest import free_ports, wait_for

JAR_PLACES = ("/usr/share/java/zookeeper.jar", "/usr/share/zookeeper/zookeeper.jar",
              "/usr/share/zookeeper/lib/zookeeper-*.jar")
TICK_MS = 100  # sessions may be as short as 2 ticks: the tests use short session timeouts


def zookeeper_classpath() -> str | None:
    """The ZooKeeper jar (its manifest names its dependencies), if it and a Java runtime are installed."""
    if shutil.which("java") is None:
        return None
    for place in JAR_PLACES:
        found = sorted(glob.glob(place))
        if found:
            return found[0]
    return None


class ZooKeeperServer:
    """`ZooKeeperServerMain` with its own data dir; stops and starts again on the same port."""

    def __init__(self, workdir: Path, classpath: str) -> None:
        self.workdir = workdir
        self.classpath = classpath
        self.port = free_ports(1, owner=self)[0]  # kept while down for a restart: its clients know it
        self.hosts = f"127.0.0.1:{self.port}"
        self.data_dir = workdir / "data"
        self.config_path = workdir / "zoo.cfg"
        self.log_path = workdir / "zookeeper.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> ZooKeeperServer:
        """Start and wait until it answers. On a first start, a port picked as free that another
        process took meanwhile (the JVM binds it a second or two later) is picked again; a restart
        keeps its port, which its clients know."""
        first = self.proc is None and not self.log_path.exists()
        for attempt in range(3):
            try:
                return self._start(timeout)
            except RuntimeError:
                if not first or attempt == 2 or not self._port_taken():
                    raise
                self.port = free_ports(1, owner=self)[0]
                self.hosts = f"127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _port_taken(self) -> bool:
        """Whether another process holds the port (ZooKeeper's own log, without an SLF4J binding,
        does not say why it exited)."""
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", self.port))
            except OSError:
                return True
        return False

    def _start(self, timeout: float) -> ZooKeeperServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            f"tickTime={TICK_MS}\ndataDir={self.data_dir}\nclientPort={self.port}\n"
            f"clientPortAddress=127.0.0.1\nmaxSessionTimeout=60000\nadmin.enableServer=false\n"
            f"4lw.commands.whitelist=ruok\n")
        command = ["java", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-cp", self.classpath,
                   "org.apache.zookeeper.server.ZooKeeperServerMain", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_for(self.proc, self.ready, f"answering on {self.port}", timeout)
        except RuntimeError as e:
            raise RuntimeError(f"zookeeper: {e}: see {self.log_path}") from None
        return self

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(4) == b"imok"
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, wipe: bool = True) -> ZooKeeperServer:
        """Stop, and start again on the same port; `wipe` forgets every session and znode."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return self.start()
