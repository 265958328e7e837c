"""Starting and stopping the server: listeners, the expiry sweeper, signals, a clean shutdown."""

from __future__ import annotations

import importlib
import resource
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gevent
import structlog

from service.config import ServerConfig
from service.server import KestrelServer

if TYPE_CHECKING:
    from service.zookeeper import ServerSetMembership

log = structlog.get_logger("kestrel.app")

# (config field, module, factory) for each listener; a port of 0 disables it.
LISTENERS = (
    ("thrift_port", "service.thrift", "make_thrift_server"),
    ("memcache_port", "service.memcache", "make_memcache_server"),
    ("text_port", "service.text", "make_text_server"),
    ("admin_port", "service.admin", "make_admin_server"),
)


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


class App:
    """One running server: its KestrelServer and its listeners."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server = KestrelServer(config)
        self.listeners: list[Any] = []
        self.membership: ServerSetMembership | None = None  # with a `zookeeper` setting

    def start(self) -> None:
        cfg = self.config
        fds = raise_open_file_limit()
        self.server.collection.load()
        self.server.collection.start_sweeper(cfg.expiration_timer_frequency)
        ports = {}
        for field, module_name, factory_name in LISTENERS:
            port = getattr(cfg, field)
            if not port:
                continue
            factory: Callable[..., Any] = getattr(importlib.import_module(module_name), factory_name)
            listener = factory(self.server, (cfg.listen_address, port))
            listener.start()
            self.listeners.append(listener)
            ports[field] = listener.address[1]
        if cfg.zookeeper is not None:
            from service.zookeeper import ServerSetMembership

            endpoints = {field.removesuffix("_port"): port for field, port in ports.items()}
            self.membership = ServerSetMembership(cfg.zookeeper, endpoints, cfg.listen_address,
                                                  self.server.status)
            self.membership.start()
        log.info("kestrel started", version=self.server.version, queue_path=cfg.queue_path,
                 listen_address=cfg.listen_address, status=self.server.status.current.label,
                 queues=len(self.server.collection.queue_names()), open_files=fds, **ports)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, let calls in flight answer, then flush and fsync every journal."""
        log.info("kestrel shutting down")
        if self.membership is not None:
            self.membership.stop()  # clients stop sending here before the listeners close
        for listener in self.listeners:
            listener.close()
        self.server.collection.close()  # wakes waiting readers, fsyncs journals
        for listener in self.listeners:
            listener.stop(timeout=timeout)
        log.info("kestrel stopped")

    def run(self) -> None:
        """Serve until SIGTERM, SIGINT or a `shutdown` command; SIGHUP reloads queue settings."""
        self.start()
        gevent.signal_handler(signal.SIGTERM, self.server.request_shutdown)
        gevent.signal_handler(signal.SIGINT, self.server.request_shutdown)
        gevent.signal_handler(signal.SIGHUP, self._reload)
        self.server.shutdown_requested.wait()
        self.stop()

    def _reload(self) -> None:
        try:
            self.server.reload()
        except Exception as e:
            log.error("reload failed; keeping the current settings", error=str(e))
