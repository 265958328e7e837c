"""Where the servers are: a fixed list, or the ZooKeeper server sets the servers join.

Both answer `writers()` (servers taking puts) and `readers()` (servers to read from) as lists of
(host, port); the lists are replaced whole, never changed in place, so readers need no lock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.states import WatchedEvent, ZnodeStat

from kestrel.client.checks import check_seconds
from kestrel.client.cooperation import gevent_sockets
from kestrel.client.errors import ServerSetsUnavailable
from kestrel.contract import server_sets

log = logging.getLogger("kestrel.client")

Address = tuple[str, int]
DEFAULT_THRIFT_PORT = 2229
RETRY_S = 1.0  # a watch that could not be set is set again this much later
RETRY_MAX_DELAY_S = 2.0  # the longest pause between two tries of a ZooKeeper call (kazoo adds 40% jitter)
MAX_MEMBER_BYTES = 64 * 1024  # a member's data is a few hundred bytes; more is no member, and is not parsed


@runtime_checkable
class ServerSource(Protocol):
    """What a Cluster asks for the servers: the write set, the read set."""

    def writers(self) -> list[Address]: ...

    def readers(self) -> list[Address]: ...

    def close(self) -> None: ...


def parse_address(text: str, default_port: int = DEFAULT_THRIFT_PORT) -> Address:
    """`host:port` (or `host`, on the default Thrift port) → (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = port, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad server address {text!r}: expected host:port")
    return host, int(port)


def as_address(server: str | Address) -> Address:
    """An address given as `host:port` or as (host, port); TypeError or ValueError naming it
    otherwise, before any connection is tried."""
    if isinstance(server, str):
        return parse_address(server)
    if not isinstance(server, (tuple, list)) or len(server) != 2 or not isinstance(server[0], str):
        raise TypeError(f"bad server address {server!r}: expected 'host:port' or (host, port)")
    host, port = server
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not host or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bad server address {server!r}: expected a host and a port of 1..65535")
    return host, port


class StaticServers:
    """A fixed list: every server takes puts and reads."""

    def __init__(self, servers: Iterable[str | Address]) -> None:
        if isinstance(servers, (str, bytes)):  # iterated, a str would be a server a character
            raise TypeError(f"servers must be a list of addresses, not one string: [{servers!r}]")
        self.servers = [as_address(s) for s in servers]
        if not self.servers:
            raise ValueError("no servers given")

    def writers(self) -> list[Address]:
        return self.servers

    def readers(self) -> list[Address]:
        return self.servers

    def close(self) -> None:
        pass


def member_address(data: bytes, endpoint: str | None) -> Address | None:
    """The address a ServerSet member advertises for `endpoint` (None: its default endpoint); None
    when it offers none a client could use. The address is held to `as_address`'s rule, so that a
    member another service wrote (port 0, an empty host) is ignored here, not raised by every call;
    so is data that is no member at all, oversized or nested past what the parser can follow
    (RecursionError), which escaped the watch and froze the lists."""
    if len(data) > MAX_MEMBER_BYTES:
        return None
    try:
        member = json.loads(data)
        if member.get("status", "ALIVE") != "ALIVE":
            return None
        where = member["serviceEndpoint"] if endpoint is None else member["additionalEndpoints"][endpoint]
        return as_address((where["host"], where["port"]))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _kazoo_handler() -> Any:
    """Kazoo's gevent handler once gevent has patched sockets, else its threading one."""
    if not gevent_sockets():
        return SequentialThreadingHandler()
    from kazoo.handlers.gevent import SequentialGeventHandler

    return SequentialGeventHandler()


class ZooKeeperServerSets:
    """The `<path_prefix>/write` and `<path_prefix>/read` server sets, kept current by watches.

    While ZooKeeper is unreachable the last lists stay in use; after a session timeout without a
    connection the ZooKeeper session is started afresh (an ensemble restarted empty refuses to
    resume old sessions), and the watches are set again once it connects. Setting them, or reading
    a member, can still fail then (ConnectionLoss while ZooKeeper restarts, or goes away again):
    the watches are set again a second later, until they hold, so the lists never freeze.

    `hosts` is kazoo's connection string (`"zk1:2181,zk2:2181"`, optionally ending in a chroot);
    `session_timeout` (seconds) is the ZooKeeper session's; `connect_timeout` (seconds) is how long
    the first connection may take before ServerSetsUnavailable. Construction either returns watching
    sets or raises and leaves no session behind. Use it as a context manager, or call `close()`.
    """

    SETS = ("write", "read")

    def __init__(self, hosts: str, path_prefix: str = "/kestrel", *, endpoint: str | None = "thrift",
                 session_timeout: float = 10.0, connect_timeout: float = 10.0) -> None:
        what = "ZooKeeperServerSets"
        checked: dict[str, str] = {}
        for setting, check, given in (("hosts", server_sets.checked_hosts, hosts),
                                      ("path_prefix", server_sets.checked_path, path_prefix)):
            try:
                checked[setting] = check(given)
            except ValueError as e:
                raise ValueError(f"{what}: {setting}: {e}") from None
        for name, value in (("session_timeout", session_timeout), ("connect_timeout", connect_timeout)):
            if not check_seconds(value, name, what) > 0:
                raise ValueError(f"{what}: {name} must be positive, got {value}")
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint):
            raise ValueError(f"{what}: endpoint must be a member endpoint's name ('thrift'), or None for "
                             f"each member's default endpoint, got {endpoint!r}")
        self.hosts, self.path_prefix, self.endpoint = hosts, checked["path_prefix"], endpoint
        self.session_timeout = session_timeout
        self._lists: dict[str, list[Address]] = {name: [] for name in self.SETS}
        self._members: dict[str, dict[str, Address | None]] = {name: {} for name in self.SETS}
        self._closed = False
        self._renewal: object | None = None  # the pending renewal's token (`_renew`)
        handler = _kazoo_handler()
        retry = {"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": RETRY_MAX_DELAY_S,  # forever,
                 "sleep_func": handler.sleep_func}  # often
        # Calls (the watches' reads among them) are retried as often, for up to a session timeout, then
        # fail and are set again by `_watch_later`: kazoo's default waits up to an hour between tries,
        # so a watch whose read met ConnectionLoss while ZooKeeper restarted stayed unset that long.
        self.zk = KazooClient(hosts=hosts, timeout=session_timeout, handler=handler, connection_retry=retry,
                              command_retry={**retry, "deadline": session_timeout})
        self._generation = 0  # each reading of the sets afresh retires the reads of the one before
        self._lives: dict[str, int | None] = {}  # set name -> the creation zxid of its node (None: deleted)
        self._watch_lock = threading.Lock()  # held for no I/O, so a thread's lock under gevent too
        # One reading of the sets at a time (the last begun is kept), held across ZooKeeper's calls:
        # the handler's lock, a greenlet's under gevent, since a thread's blocked the whole hub.
        self._read_lock = self.zk.handler.lock_object()
        self.zk.start_async().wait(connect_timeout)
        if not self.zk.connected:
            # kazoo's stop waits for its connection's handshake, up to a session timeout (a frozen
            # ensemble's, or a port that accepts and never answers): the session ends beside the caller.
            self._closed = True
            self.zk.handler.spawn(self._end_session)
            raise ServerSetsUnavailable(f"cannot reach ZooKeeper at {hosts} within {connect_timeout}s")
        try:
            self.zk.add_listener(self._on_state)
            self._watch(self._generation, retry=False)
        except KazooException as e:
            self.close()
            raise ServerSetsUnavailable(f"ZooKeeper at {hosts}: cannot watch the server sets under "
                                        f"{self.path_prefix}: {e!r}") from e
        except BaseException:
            self.close()  # never leave a session (and kazoo's threads) behind
            raise

    def _watch(self, generation: int, retry: bool = True) -> None:
        """Read both sets afresh, retiring earlier reads (kazoo drops a watch whose node went missing,
        as the sets do when an ensemble restarts empty, so each connection reads and watches anew);
        nothing if `generation` was retired meanwhile. A failure is tried again after RETRY_S (raised
        instead when not `retry`: the first watch, in the constructor)."""
        with self._watch_lock:
            if self._closed or generation != self._generation:
                return
            self._generation += 1
            generation = self._generation
            # Member names are unique only within one life of a set's node: an ensemble restarted
            # empty numbers its members from 0 again, so a name known before may now be another server's.
            self._members = {name: {} for name in self.SETS}
            self._lives = {}
        try:
            with self._read_lock:
                for name in self.SETS:
                    path = f"{self.path_prefix}/{name}"
                    try:
                        self.zk.ensure_path(path)
                    except KazooException as e:  # read-only access: the servers create the sets
                        log.debug("cannot create the server set path %s: %r", path, e)
                    self._read_node(name, generation)
        except KazooException as e:
            if not retry:
                raise
            self._watch_later(generation, f"cannot watch the server sets: {e!r}")

    def _watch_later(self, generation: int, why: str) -> None:
        """Set the watches again after RETRY_S, unless a newer generation has set them by then."""
        if self._closed:
            return
        log.warning("zookeeper %s: %s; keeping the last server lists, watching again in %.0f s", self.hosts,
                    why, RETRY_S)
        self._later(RETRY_S, partial(self._watch, generation))

    def _later(self, seconds: float, work: Callable[[], None]) -> None:
        """Run `work` after `seconds` on kazoo's handler: in a thread of its own, or in a greenlet
        under gevent (a thread's timer failed there to touch the client, "cannot switch to a
        different thread", where gevent had patched sockets and not threads: the lists froze)."""
        def run() -> None:
            self.zk.handler.sleep_func(seconds)
            work()

        self.zk.handler.spawn(run)

    def writers(self) -> list[Address]:
        return self._lists["write"]

    def readers(self) -> list[Address]:
        return self._lists["read"]

    def _on_node_event(self, event: WatchedEvent) -> None:
        """A set's node changed, went or came: read it again, which arms its watch again."""
        self._on_event(event, children=False)

    def _on_children_event(self, event: WatchedEvent) -> None:
        """A set's members changed: read them again, which arms their watch again."""
        self._on_event(event, children=True)

    def _on_event(self, event: WatchedEvent, children: bool) -> None:
        """The watches are ZooKeeper's one-shot ones, armed by each read of a node with one of these two
        methods. Kazoo drops every watch when the connection goes, calling it with an event without a
        path (nothing to do: the next connection reads the sets afresh, arming them again), and keeps a
        method armed twice on a node once; so the client holds one watch per node however often it
        reconnects. Kazoo's recipes instead were one more pair per connection, each reading its node
        again at every later one, and stopped only when a change called them back.
        """
        if event.path is None or self._closed:
            return
        name = event.path.rpartition("/")[2]
        with self._read_lock:
            generation = self._generation
            try:
                if not children:
                    self._read_node(name, generation)
                elif (life := self._lives.get(name)) is not None:
                    self._read_children(name, generation, life)
            except KazooException as e:
                self._watch_later(generation, f"cannot read the server set {name}: {e!r}")

    def _read_node(self, name: str, generation: int) -> None:
        """Read a set's node, watching it; a new life of it has its members read.

        A set deleted (an operator's `deleteall`) has no members, and one made again is a new life,
        whose members are read afresh. A life is the node's creation transaction, so a node deleted
        and made again between two looks is still seen as new. Called with `_read_lock` held.
        """
        path = f"{self.path_prefix}/{name}"
        stat: ZnodeStat | None = None
        while stat is None:
            try:
                _, stat = self.zk.retry(self.zk.get, path, watch=self._on_node_event)
            except NoNodeError:  # watch for its creation instead; made meanwhile: read it
                if self.zk.retry(self.zk.exists, path, watch=self._on_node_event) is None:
                    break
        life = stat.czxid if stat is not None else None
        with self._watch_lock:
            if self._closed or generation != self._generation:
                return
            if name in self._lives and self._lives[name] == life:
                return  # the same node (its data changed): its children watch goes on
            self._lives[name] = life
            self._members[name] = {}  # member names are unique only within one life of the node
            if life is None:
                self._lists[name] = []
        if life is None:
            log.info("server set %s/%s: deleted", self.path_prefix, name)
            return
        self._read_children(name, generation, life)

    def _read_children(self, name: str, generation: int, life: int) -> None:
        """Read the members of one life of a set, watching them. Called with `_read_lock` held."""
        path = f"{self.path_prefix}/{name}"
        try:
            children, stat = self.zk.retry(self.zk.get_children, path, watch=self._on_children_event,
                                           include_data=True)
        except NoNodeError:
            return  # deleted meanwhile: its node's watch says so
        if stat.czxid != life:
            return  # another life of the node, which its node's watch reads
        known = self._members[name]
        fresh: dict[str, Address | None] = {}
        for child in children:
            if child in known:
                fresh[child] = known[child]  # members never change their data
                continue
            try:
                data, _ = self.zk.retry(self.zk.get, f"{path}/{child}")
            except NoNodeError:
                continue
            except NoAuthError:  # another service's node, under its ACL: it froze the lists
                log.warning("ignoring server set member %s/%s: its ACL does not let this client read it",
                            name, child)
                fresh[child] = None
                continue
            fresh[child] = member_address(data, self.endpoint)
            if fresh[child] is None:
                log.warning("ignoring server set member %s/%s: no usable %s endpoint in %.200r", name, child,
                            self.endpoint or "default", data)
        with self._watch_lock:  # a view read with the members of a retired generation is not kept
            if generation != self._generation or self._lives.get(name) != life:
                return
            self._members[name] = fresh
            self._lists[name] = sorted({a for a in fresh.values() if a is not None})
        log.info("server set %s/%s: %s", self.path_prefix, name,
                 ", ".join(f"{h}:{p}" for h, p in self._lists[name]) or "empty")

    def _on_state(self, state: str) -> None:
        if state == KazooState.CONNECTED or self._closed:
            self._renewal = None  # a renewal pending is called off
            if not self._closed:
                self.zk.handler.spawn(partial(self._watch, self._generation))
            return
        log.warning("zookeeper %s: connection %s; keeping the last server lists", self.hosts, state)
        if self._renewal is None:
            token = self._renewal = object()
            self._later(self.session_timeout, partial(self._renew, token))

    def _renew(self, token: object) -> None:
        if token is not self._renewal:  # called off: connected since, or closed
            return
        self._renewal = None
        if self._closed or self.zk.state == KazooState.CONNECTED:
            return
        log.warning("zookeeper %s: no connection for a session timeout; starting a new session", self.hosts)
        self.zk.stop()
        self.zk.start_async()

    def __enter__(self) -> ZooKeeperServerSets:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End the ZooKeeper session; the last lists stay readable. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._renewal = None
        self._end_session()

    def _end_session(self) -> None:
        self.zk.stop()
        self.zk.close()
