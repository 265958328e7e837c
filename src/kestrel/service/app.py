"""Starting and stopping the server: listeners, the expiry sweeper, signals, a clean shutdown.

Each start-up step that can fail for a reason outside the server runs in a `startup_step`
(src/kestrel/service/startup.py), which reports it in one line with its exit code.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import resource
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import gevent
import structlog

from kestrel.build import build_name
from kestrel.service import metrics, service_manager, start_signals
from kestrel.service.config import ServerConfig
from kestrel.service.gc_pauses import GC_PAUSES
from kestrel.service.listener import Listener, is_loopback
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.status import status_file_problem
from kestrel.service.startup import EXIT_LISTENER, EXIT_QUEUE_PATH, startup_step
from kestrel.storage import filenames
from kestrel.storage.errors import KestrelError
from kestrel.storage.fsync import group_commit
from kestrel.storage.fsync.completion_cpu import completion_cpu
from kestrel.storage.lock import QueuePathLock
from kestrel.storage.runtime import DEFAULT_RUNTIME

if TYPE_CHECKING:
    from kestrel.service.zookeeper import ServerSetMembership

log = structlog.get_logger("kestrel.app")

# (config field, module, factory) for each listener; a port of 0 disables it.
LISTENERS = (
    ("thrift_port", "kestrel.service.thrift.handler", "make_thrift_server"),
    ("memcache_port", "kestrel.service.memcache.handler", "make_memcache_server"),
    ("text_port", "kestrel.service.text.handler", "make_text_server"),
    ("admin_port", "kestrel.service.admin", "make_admin_server"),
)
# How often a stop waiting for busy connections looks whether it was asked again (`_stop_signal`).
CUT_OFF_LOOK_S = 0.1


def raise_open_file_limit() -> int:
    """Thousands of idle connections need as many descriptors as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def check_status_file(status_file: str, queue_path: str) -> None:
    """The status is written as `<file>~~` and renamed over the file (StatusKeeper.set): make sure
    now, at start, that it can be, rather than at the first status change, and that what it would
    replace is a status file (`status.status_file_problem`)."""
    problem = status_file_problem(status_file, queue_path)
    if problem is not None:
        raise problem
    temp = status_file + filenames.TEMPORARY_MARK
    try:
        with open(temp, "w", encoding="utf-8"):
            pass
        os.unlink(temp)
    except OSError as e:  # named by the file it is about, not by the temporary
        directory = os.path.dirname(os.path.abspath(status_file))
        if e.errno == errno.ENOENT and os.path.isdir(directory):  # /proc, /sys: ENOENT for a new file
            raise OSError(None, f"no file can be created in its directory {directory}", status_file) from None
        raise OSError(e.errno, e.strerror, status_file) from None


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class App:
    """One running server: its ServerState and its listeners."""

    def __init__(self, config: ServerConfig) -> None:
        """Take the queue path (created if missing) and open the server's state; raises StartupError."""
        self.config = config
        self._cut_off = False  # a second stop signal came: close busy connections now (`_stop_signal`)
        self.lock = QueuePathLock(config.queue_path)  # held for the process's life: one owner per path
        with startup_step("queue path", config.queue_path, EXIT_QUEUE_PATH):
            os.makedirs(config.queue_path, exist_ok=True)
            self.lock.acquire("kestrel serve")
        try:
            status_file = config.resolved_status_file()
            if status_file is not None:  # before the status is read from it
                with startup_step("status file", status_file, EXIT_QUEUE_PATH):
                    check_status_file(status_file, config.queue_path)
            with startup_step("queue path", config.queue_path, EXIT_QUEUE_PATH):
                # gevent's runtime: the listeners serve on its hub, and the storage and the sessions
                # under them take their clock, timers and events from it.
                self.server = ServerState(config, runtime=DEFAULT_RUNTIME)
        except BaseException:
            self.lock.release()
            raise
        self.listeners: list[Listener] = []
        self.membership: ServerSetMembership | None = None  # with a `zookeeper` setting

    def start(self) -> None:
        """Load the queues and open the listeners; raises StartupError (see
        src/kestrel/service/startup.py)."""
        cfg = self.config
        fds = raise_open_file_limit()
        metrics.install_storage_timing()
        rounds = group_commit.shared()  # now, so that a word about KESTREL_FSYNC comes at start, in the log
        cpu = completion_cpu(cfg.queue_path)
        # the CPU that takes the queue path's disk completions, where the fsync rounds then run
        fsync_cpu = {"fsync_cpu": cpu} if cpu is not None and rounds.run_rounds_on(cpu) else {}
        status_file = cfg.resolved_status_file()
        service_manager.notify("STATUS=loading the queues")
        with startup_step("queue path", cfg.queue_path, EXIT_QUEUE_PATH):
            self.server.collection.load()
        # From here a stop is clean; taken before any listener can let a client in.
        gevent.signal_handler(signal.SIGTERM, self._stop_signal)
        gevent.signal_handler(signal.SIGINT, self._stop_signal)
        GC_PAUSES.freeze_loaded()  # no full collection walks the loaded queues while clients wait
        self.server.collection.start_sweeper(cfg.expiration_timer_frequency)
        if self.server.collection.governor is not None:
            self.server.collection.governor.start()
        ports = {}
        for field, module_name, factory_name in LISTENERS:
            port = getattr(cfg, field)
            if not port:
                continue
            name = field.removesuffix("_port")
            with startup_step(f"{name} listener", host_port(cfg.listen_address, port), EXIT_LISTENER):
                factory: Callable[..., Listener] = getattr(importlib.import_module(module_name), factory_name)
                listener = factory(self.server, (cfg.listen_address, port))
            listener.start()
            self.listeners.append(listener)
            ports[field] = listener.address[1]
        if cfg.zookeeper is not None:
            from kestrel.service.zookeeper import ServerSetMembership

            endpoints = {field.removesuffix("_port"): port for field, port in ports.items()}
            self.membership = ServerSetMembership(cfg.zookeeper, endpoints, cfg.listen_address,
                                                  self.server.status)
            self.membership.start()
            self.server.membership = self.membership.report
        if not is_loopback(cfg.listen_address):
            log.warning("listening beyond this machine: nothing authenticates clients, so any host that "
                        "reaches these ports may read, write, flush or shut down; keep them on a private "
                        "network or behind a firewall", listen_address=cfg.listen_address)
        queues = self.server.collection.queue_count()
        log.info("kestrel started", version=self.server.version, build=build_name(),
                 queue_path=os.path.abspath(cfg.queue_path), listen_address=cfg.listen_address,
                 status=self.server.status.current.label, queues=queues, open_files=fds, **ports, **fsync_cpu,
                 status_file=None if status_file is None else os.path.abspath(status_file))
        service_manager.notify("READY=1", f"STATUS=serving; queues: {queues}")

    def stop(self) -> None:
        """Leave the server sets first, so clients stop sending here; then stop accepting at once; let
        every connection answer what it has read and then see the end of its stream, so idle ones close
        at once and their sessions abort their open reads; wake waiting reads empty-handed; only then
        close the queues (journals flushed and fsynced)."""
        started = time.monotonic()
        log.info("kestrel shutting down", connections=sum(len(lst.connections) for lst in self.listeners))
        service_manager.notify("STOPPING=1", "STATUS=stopping")
        if self.membership is not None:
            self.membership.stop()
        for listener in self.listeners:
            listener.stop_accepting()
        for listener in self.listeners:
            listener.end_reading()
        self.server.collection.end_waits()
        deadline = started + self.config.shutdown_timeout / 1000.0
        for listener in self.listeners:
            while not listener.join(min(CUT_OFF_LOOK_S, max(deadline - time.monotonic(), 0.0))):
                if time.monotonic() >= deadline or self._cut_off:
                    log.warning("closing connections still busy at the shutdown timeout" if not self._cut_off
                                else "closing connections still busy: stop asked again",
                                listener=listener.name, connections=len(listener.connections))
                    listener.kill()
                    break
        self.server.close()
        self.lock.release()
        log.info("kestrel stopped", seconds=round(time.monotonic() - started, 3))

    def _stop_signal(self) -> None:
        """SIGTERM or SIGINT: a stop; asked again while stopping, the connections still busy are
        closed at once rather than at `shutdown_timeout` (the journals flushed and fsynced as in
        every stop), where the second signal did nothing until then."""
        if self.server.shutdown_requested.is_set() and not self._cut_off:
            self._cut_off = True
            log.warning("stop asked again: connections still busy are closed now")
        self.server.request_shutdown()

    def run(self) -> None:
        """Serve until SIGTERM, SIGINT or a `shutdown` command; SIGHUP reloads queue settings."""
        # Until the queues are loaded SIGTERM and SIGINT end the process at once (`start_signals`,
        # from the command's first line; without it, their default action): nothing has been
        # served yet, and a start-up killed at any point loses nothing (docs/durability.md), where
        # the loop would see them only once a long replay had ended. Their handlers come in
        # `start`, once the queues are loaded. A reload asked for meanwhile, here or before,
        # waits for the queues, where the default action would kill the process.
        start_signals.install()  # (again, for a server not started by the command)
        gevent.signal_handler(signal.SIGHUP, self._reload)
        if start_signals.reload_asked():
            gevent.spawn(self._reload)
        GC_PAUSES.install(gevent.get_hub().loop.run_callback_threadsafe, self.server.collection.queue_count)
        try:
            try:
                self.start()
            except BaseException:
                self._abandon_start()
                raise
            self.server.shutdown_requested.wait()
            self.stop()
        finally:
            GC_PAUSES.uninstall()  # no walk asked of a loop that no longer runs

    def _abandon_start(self) -> None:
        """After a failed start: close what was opened, so that the journals loaded so far are flushed
        and the lock dropped. A second failure here must not hide the first, which is reported."""
        for listener in self.listeners:
            listener.stop_accepting()
        with contextlib.suppress(OSError, KestrelError):
            self.server.close()
        self.lock.release()

    def _reload(self) -> None:
        with contextlib.suppress(Exception):  # logged by `reload`: the current settings are kept
            self.server.reload()
