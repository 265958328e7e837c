"""Membership of the cluster's ZooKeeper server sets, `<path_prefix>/write` and `<path_prefix>/read`.

A server is a member of the sets its status allows (Up: both, ReadOnly: read, Quiescent: none), as
an ephemeral sequential `member_` znode holding Twitter's ServerSet JSON, so that ServerSet-aware
clients (Finagle's resolver, go.serversets, `client/`) read it unchanged. The membership follows
status changes at once (the grace period delays only the refusals, so clients learn first) and is
rebuilt whenever a new ZooKeeper session starts, or a member of ours is deleted from outside.

All ZooKeeper work runs in one background greenlet on kazoo's gevent handler: a ZooKeeper that is
down, slow or restarting never delays a request.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import gevent
import gevent.event
import structlog
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoNodeError
from kazoo.handlers.gevent import SequentialGeventHandler
from kazoo.protocol.states import WatchedEvent

from kestrel.service.config import ZooKeeperConfig
from kestrel.service.session.status import Status, StatusKeeper

log = structlog.get_logger("kestrel.zookeeper")

# Joined in this order and left in the reverse one, so that a server never takes writes it
# could not be read from.
SET_NAMES = ("read", "write")
# The default endpoint is the first of these that is enabled.
ENDPOINT_PREFERENCE = ("memcache", "thrift", "text")
RETRY_DELAY = 0.5  # seconds before retrying a membership change ZooKeeper failed
# A change that failed otherwise (a fault of ours) is retried after twice the wait of the last, up
# to this: the membership never ends while the server serves, and a lasting fault logs seldom.
MOST_UNEXPECTED_DELAY = 30.0
# Kazoo logs every failed reconnection attempt; our own lines report each state change once.
KAZOO_LOG = logging.getLogger("kestrel.zookeeper.kazoo")
KAZOO_LOG.setLevel(logging.ERROR)


def sets_for(status: Status) -> tuple[str, ...]:
    """The server sets a status belongs in. A server without a status file is always Up."""
    if status in (Status.UP, Status.NOT_CONFIGURED):
        return SET_NAMES
    if status == Status.READ_ONLY:
        return ("read",)
    return ()


def member_data(host: str, endpoints: dict[str, int]) -> bytes:
    """The ServerSet JSON for a server: its default endpoint, every endpoint by name, ALIVE."""
    named = {name: {"host": host, "port": endpoints[name]}
             for name in ENDPOINT_PREFERENCE if name in endpoints}
    if not named:
        raise ValueError("no memcache, thrift or text endpoint to advertise")
    default = next(iter(named.values()))
    return json.dumps({"serviceEndpoint": default, "additionalEndpoints": named,
                       "status": "ALIVE"}).encode("utf-8")


def advertised_host(config: ZooKeeperConfig, listen_address: str) -> str:
    """The host clients should connect to: configured, else the listen address unless it is a wildcard."""
    if config.advertise_host:
        return config.advertise_host
    if listen_address in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return listen_address


class ServerSetMembership:
    """Keeps this server's member znodes in step with its status and its ZooKeeper session."""

    def __init__(self, config: ZooKeeperConfig, endpoints: dict[str, int], listen_address: str,
                 status: StatusKeeper) -> None:
        self.config = config
        self.status = status
        self.host = advertised_host(config, listen_address)
        self.data = member_data(self.host, endpoints)
        handler = SequentialGeventHandler()
        self.zk = KazooClient(
            hosts=config.hosts, timeout=config.session_timeout / 1000.0, handler=handler, logger=KAZOO_LOG,
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2.0,
                              "sleep_func": handler.sleep_func})
        self._joined: dict[str, str] = {}  # set name -> our member znode in the current session
        self._wake = gevent.event.Event()
        self._stopping = False
        self._disconnected_since: float | None = time.monotonic()
        self._worker: gevent.Greenlet | None = None

    @property
    def members(self) -> dict[str, str]:
        """Our member znode in each set we are in, as far as we know: set name -> path."""
        return dict(self._joined)

    def report(self) -> dict[str, bool]:
        """`connected` to ZooKeeper, and a member of each set (`read`, `write`) as far as we know."""
        return {"connected": self._disconnected_since is None,
                **{name: name in self._joined for name in SET_NAMES}}

    def set_path(self, name: str) -> str:
        return f"{self.config.path_prefix}/{name}"

    def start(self) -> None:
        """Connect in the background; membership follows once a session is up."""
        self.zk.add_listener(self._on_state)
        self.status.subscribe(lambda previous, current: self._wake.set())
        self._worker = gevent.spawn(self._run)
        self.zk.start_async()
        log.info("joining zookeeper server sets", hosts=self.config.hosts,
                 path_prefix=self.config.path_prefix, host=self.host)

    def _on_state(self, state: str) -> None:
        """Kazoo's connection listener: log, forget members of a dead session, and wake the worker."""
        if state == KazooState.CONNECTED:
            self._disconnected_since = None
            log.info("zookeeper connected", hosts=self.config.hosts)
        else:
            self._disconnected_since = self._disconnected_since or time.monotonic()
            if state == KazooState.LOST and self._stopping:
                log.info("zookeeper session closed", hosts=self.config.hosts)
            elif state == KazooState.LOST:
                self._joined.clear()  # ZooKeeper removes them with the session
                log.warning("zookeeper session lost; will rejoin with a new one", hosts=self.config.hosts)
            else:
                log.warning("zookeeper connection suspended; members stay while the session lives",
                            hosts=self.config.hosts)
        self._wake.set()

    def _run(self) -> None:
        patience = self.config.session_timeout / 1000.0
        unexpected_delay = RETRY_DELAY
        while True:
            self._wake.wait(timeout=patience)
            self._wake.clear()
            if self._stopping:
                return
            if self.zk.state != KazooState.CONNECTED:
                self._renew_if_stuck(patience)
                continue  # the listener wakes us on reconnect
            try:
                self._reconcile()
                unexpected_delay = RETRY_DELAY
            except (KazooException, self.zk.handler.timeout_exception) as e:
                log.warning("zookeeper membership change failed; retrying", error=repr(e))
                gevent.sleep(RETRY_DELAY)
                self._wake.set()
            except Exception:
                log.exception("zookeeper membership change failed unexpectedly; retrying",
                              seconds=unexpected_delay)
                gevent.sleep(unexpected_delay)
                unexpected_delay = min(unexpected_delay * 2, MOST_UNEXPECTED_DELAY)
                self._wake.set()

    def _renew_if_stuck(self, patience: float) -> None:
        """Start afresh after a session timeout without a connection.

        An ensemble that lost its data (rebuilt, or restarted empty) refuses to resume a session that
        has seen newer transactions than it has, so kazoo would retry forever: a new client session
        starts clean. Our members of the old session, if it still lives, are removed on rejoining.
        """
        since = self._disconnected_since
        if since is None or time.monotonic() - since < patience:
            return
        log.warning("no zookeeper connection for a session timeout; starting a new session",
                    hosts=self.config.hosts, seconds=round(time.monotonic() - since, 1))
        self._disconnected_since = time.monotonic()
        self.zk.stop()
        self.zk.start_async()

    def _reconcile(self) -> None:
        wanted = sets_for(self.status.current)
        session = self.zk.client_id[0] if self.zk.client_id else None
        for name in SET_NAMES:
            if name in wanted:
                self._join(name, session)
        for name in reversed(SET_NAMES):
            if name not in wanted:
                self._leave(name)

    def _join(self, name: str, session: int | None) -> None:
        path = self._joined.get(name)
        if path is not None:
            stat = self.zk.exists(path, watch=self._on_member_event)
            if stat is not None and stat.ephemeralOwner == session:
                return
            if stat is None:
                log.warning("our member was deleted while our session lives; joining again", member=path)
            del self._joined[name]
        parent = self.set_path(name)
        self.zk.ensure_path(parent)
        path = self._claim(parent, session)
        if path is None:
            path = self.zk.create(f"{parent}/member_", self.data, ephemeral=True, sequence=True)
        self._joined[name] = path
        if self.zk.exists(path, watch=self._on_member_event) is None:
            self._wake.set()  # deleted before it was watched, so no event will say so: the next round rejoins
        log.info("joined server set", set=parent, member=path, status=self.status.current.label)

    def _on_member_event(self, event: WatchedEvent) -> None:
        """A member of ours changed (deleted by hand, or by us on leaving): the worker checks them all."""
        self._wake.set()

    def _claim(self, parent: str, session: int | None) -> str | None:
        """Our existing member under `parent`, if any; twins are deleted.

        A member holding exactly our endpoints is ours: left by a create whose reply was lost (this
        session: keep it) or by an earlier session that has not expired yet (delete it).
        """
        kept = None
        for child in sorted(self.zk.get_children(parent)):
            path = f"{parent}/{child}"
            try:
                data, stat = self.zk.get(path)
            except NoNodeError:
                continue
            if data != self.data:
                continue
            if kept is None and stat.ephemeralOwner == session:
                kept = path
            else:
                self._delete(path)
                log.info("removed a stale member of ours", member=path)
        return kept

    def _leave(self, name: str) -> None:
        path = self._joined.pop(name, None)
        if path is None:
            return
        self._delete(path)
        log.info("left server set", set=self.set_path(name), member=path, status=self.status.current.label)

    def _delete(self, path: str) -> None:
        try:
            self.zk.delete(path)
        except NoNodeError:
            pass

    def stop(self, timeout: float = 2.0) -> None:
        """Leave every set (so clients stop sending here) and close the session."""
        self._stopping = True
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker.kill(block=False)
        for name in reversed(SET_NAMES):
            path = self._joined.pop(name, None)
            if path is None or self.zk.state != KazooState.CONNECTED:
                continue
            try:
                self.zk.delete_async(path).get(timeout=timeout)
                log.info("left server set", set=self.set_path(name), member=path, status="Down")
            except NoNodeError:
                pass
            except (KazooException, self.zk.handler.timeout_exception) as e:
                log.warning("could not leave the server set; the member goes with the session",
                            set=self.set_path(name), error=repr(e))
        self.zk.stop()
        self.zk.close()
