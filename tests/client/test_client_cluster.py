"""The client on a real cluster found through ZooKeeper: server sets, statuses, a killed server."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient

import kestrel.client.discovery as discovery
from kestrel.client import (
    Cluster,
    Refused,
    Server,
    ServerSetsUnavailable,
    ZooKeeperServerSets,
    member_address,
)
from kestrel.contract import kestrel_thrift as kestrel
from tests.conftest import PACKAGE_ROOT, ROOT, STALL_S, ServerProcess, free_port, wait_until
from tests.support.cluster import MAX_TICKER_GAP_S, hung_servers, run_gevent_script, running_servers

PREFIX = "/kestrel-cluster"


@pytest.fixture(scope="module")
def cluster3(zookeeper: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Three servers in PREFIX's sets. The second, which a test kills, has a ZooKeeper session of a
    second, so that it is gone from the sets soon after; the others a session of 20 s, which a loaded
    machine does not let run out while they live (a 1 s session did, and for a moment the write set
    was empty)."""
    def config(session_timeout: str) -> dict[str, Any]:
        return {"zookeeper": {"hosts": zookeeper.hosts, "path_prefix": PREFIX, "session_timeout": session_timeout,
                              "advertise_host": "127.0.0.1"},
                "status_change_grace_period": "300ms"}

    configs = [config("20s"), config("1s"), config("20s")]
    with running_servers(tmp_path_factory.mktemp("cluster"), configs) as servers:
        yield servers


def thrift_ports(addresses: list[tuple[str, int]]) -> set[int]:
    return {port for _, port in addresses}


def on(srv: ServerProcess) -> Server:
    return Server("127.0.0.1", srv.thrift_port)


def test_member_addresses() -> None:
    data = (b'{"serviceEndpoint": {"host": "h", "port": 1}, "additionalEndpoints": {"thrift": {"host": "h",'
            b' "port": 2}}, "status": "ALIVE"}')
    assert member_address(data, "thrift") == ("h", 2)
    assert member_address(data, None) == ("h", 1)
    assert member_address(data, "memcache") is None
    assert member_address(data.replace(b"ALIVE", b"DEAD"), "thrift") is None
    assert member_address(b"not json", "thrift") is None


def test_a_member_advertising_an_address_no_call_could_use_is_no_address() -> None:
    """Another service may write a member into the sets; what it advertises is held to the rule a
    server given by hand is, so that a member a call could never use is ignored where it is read."""
    for host, port in (("h", 0), ("h", 99999), ("h", -5), ("h", True), ("", 2229), (None, 2229), ("h", 2.5)):
        data = json.dumps({"additionalEndpoints": {"thrift": {"host": host, "port": port}}}).encode()
        assert member_address(data, "thrift") is None, (host, port)


def test_data_that_is_no_member_is_no_address() -> None:
    """Nesting past what the parser follows raised RecursionError out of member_address; data over
    MAX_MEMBER_BYTES is no member, whatever it holds, and is not parsed."""
    assert member_address(b"[" * 30_000 + b"]" * 30_000, "thrift") is None
    assert member_address(member_on(7001) + b" " * discovery.MAX_MEMBER_BYTES, "thrift") is None
    assert member_address(member_on(7001) + b" " * 1000, "thrift") == ("127.0.0.1", 7001)


def test_unreachable_zookeeper_is_a_clear_error() -> None:
    with pytest.raises(ServerSetsUnavailable, match="cannot reach ZooKeeper"):
        ZooKeeperServerSets(f"127.0.0.1:{free_port()}", PREFIX, connect_timeout=0.5)
    for hosts in ("", " ", None):
        with pytest.raises(ValueError, match="hosts: expected the ZooKeeper ensemble"):
            Cluster.from_zookeeper(hosts)  # type: ignore[arg-type]  # (kazoo's own: "bad hostname")
    for endpoint in ("", 2229):  # every member would be ignored, the cluster empty
        with pytest.raises(ValueError, match="endpoint must be a member endpoint's name"):
            Cluster.from_zookeeper("127.0.0.1:2181", endpoint=endpoint)  # type: ignore[arg-type]
    for endpoint in ("memcache", "text"):  # Thrift calls to another protocol's port: every server down
        with pytest.raises(ValueError, match=f"endpoint '{endpoint}' is a {endpoint} port; the client speaks Thrift"):
            Cluster.from_zookeeper("127.0.0.1:2181", endpoint=endpoint)
    # Each member's default endpoint, which the servers advertise as their memcache port: taken, every
    # call timed out there and the server was avoided.
    with pytest.raises(ValueError, match="endpoint None, each member's default, is the servers' memcache port; "
                                         "the client speaks Thrift"):
        Cluster.from_zookeeper("127.0.0.1:2181", endpoint=None)  # type: ignore[arg-type]


def test_from_zookeeper_takes_its_connection_options(zookeeper: Any, cluster3: list[ServerProcess]) -> None:
    started = time.monotonic()
    with pytest.raises(ServerSetsUnavailable, match="within 0.5s"):
        Cluster.from_zookeeper(f"127.0.0.1:{free_port()}", PREFIX, connect_timeout=0.5)
    assert time.monotonic() - started < STALL_S  # its 0.5 s, not the default 10 s
    # A port that accepts and never answers (a frozen ensemble): kazoo's stop waited for the
    # handshake, a session timeout (10 s here), before the error said "within 0.5s".
    with hung_servers(1, "never answers") as (silent,):
        started = time.monotonic()
        with pytest.raises(ServerSetsUnavailable, match="within 0.5s"):
            Cluster.from_zookeeper(silent, PREFIX, connect_timeout=0.5, session_timeout=10.0)
        assert time.monotonic() - started < STALL_S
    with Cluster.from_zookeeper(zookeeper.hosts, PREFIX, session_timeout=4.0, connect_timeout=5.0,
                                retries=1, timeout_ms=5_000) as cluster:
        assert isinstance(cluster.source, ZooKeeperServerSets)
        assert cluster.source.session_timeout == 4.0 and cluster.retries == 1
        wait_until(lambda: len(cluster.writers()) == 3, "three writers")
        assert cluster.put("options", b"x")
        assert cluster.get("options") == b"x"
    assert not cluster.source.zk.connected  # leaving the block ended the session


def test_a_failed_construction_leaves_no_zookeeper_session(
        zookeeper: Any, cluster3: list[ServerProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[KazooClient] = []

    class Recorded(KazooClient):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    def no_session_left() -> None:
        assert all(zk._stopped.is_set() and not zk.connected for zk in made), \
            [(zk.state, zk._stopped.is_set()) for zk in made]

    monkeypatch.setattr(discovery, "KazooClient", Recorded)
    with pytest.raises(ValueError, match="strategy"):
        Cluster.from_zookeeper(zookeeper.hosts, PREFIX, strategy="sticky")
    with pytest.raises(TypeError, match="no_such_option"):
        Cluster.from_zookeeper(zookeeper.hosts, PREFIX, no_such_option=1)
    no_session_left()
    with pytest.raises(ValueError, match="retries"):
        Cluster.from_zookeeper(zookeeper.hosts, PREFIX, retries=-1)
    with pytest.raises(ValueError, match="session_timeout"):
        Cluster.from_zookeeper(zookeeper.hosts, PREFIX, session_timeout=0)
    with pytest.raises(ValueError, match="path_prefix"):
        Cluster.from_zookeeper(zookeeper.hosts, "kestrel")
    # A failure once connected (watching the sets) ends the session it started.
    monkeypatch.setattr(ZooKeeperServerSets, "_watch", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        Cluster.from_zookeeper(zookeeper.hosts, PREFIX)
    assert made, "the watch failed after connecting"
    no_session_left()


def accepts_status(server: Any, status: int) -> bool:
    """Set `status`; False while an earlier change's grace period still refuses it."""
    try:
        server.set_status(status)
    except Refused as e:
        if "grace period" not in str(e):
            raise
        return False
    return True


def test_server_sets_follow_statuses(zookeeper: Any, cluster3: list[ServerProcess]) -> None:
    a, b, c = cluster3
    everyone = {s.thrift_port for s in cluster3}
    sets = ZooKeeperServerSets(zookeeper.hosts, PREFIX)
    wait_until(lambda: thrift_ports(sets.writers()) == thrift_ports(sets.readers()) == everyone, "three servers")
    on(a).set_status(kestrel.Status.READ_ONLY)
    on(b).set_status(kestrel.Status.QUIESCENT)
    wait_until(lambda: thrift_ports(sets.writers()) == {c.thrift_port}, "only c in the write set")
    wait_until(lambda: thrift_ports(sets.readers()) == {a.thrift_port, c.thrift_port}, "a and c in the read set")
    # Puts go to the write set only, however many there are.
    cluster = Cluster(sets)
    for i in range(9):
        cluster.put("followed", b"%d" % i)
    # A change is refused while the previous one's grace period runs: wait for it, then go back Up.
    wait_until(lambda: accepts_status(on(a), kestrel.Status.UP), "a to accept Up after its grace period")
    wait_until(lambda: accepts_status(on(b), kestrel.Status.UP), "b to accept Up after its grace period")
    wait_until(lambda: thrift_ports(sets.writers()) == everyone, "everyone back")
    # Counted once everyone is Up: a Quiescent server refuses peeks too once its grace period is over.
    assert [on(s).peek("followed").items for s in cluster3] == [0, 0, 9]
    assert cluster.get_many("followed", 100) == [b"%d" % i for i in range(9)]
    cluster.close()


def test_ten_thousand_items_survive_a_readonly_server_and_a_killed_one(
        zookeeper: Any, cluster3: list[ServerProcess]) -> None:
    total, batch = 10_000, 20
    readonly, killed, steady = cluster3
    cluster = Cluster.from_zookeeper(zookeeper.hosts, PREFIX, poll_ms=100)
    wait_until(lambda: len(cluster.writers()) == 3, "three writers")
    produced = 0
    errors: list[BaseException] = []

    def produce() -> None:
        nonlocal produced
        try:
            for start in range(0, total, batch):
                items = [b"item-%05d" % i for i in range(start, start + batch)]
                assert cluster.put_many("e2e", items) == batch
                produced = start + batch
                time.sleep(0.002)  # real time: production keeps going while the cluster changes
        except BaseException as e:
            errors.append(e)

    deliveries: Counter[bytes] = Counter()
    stop = threading.Event()
    flowing = threading.Event()  # cleared: the consumer holds its batch of open reads, unconfirmed
    flowing.set()

    def handle(item: bytes) -> None:
        flowing.wait()
        deliveries[item] += 1

    def consume() -> None:
        try:
            cluster.consume("e2e", handle, batch=50, stop=stop)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    wait_until(lambda: produced >= total // 4, "a quarter produced", timeout=30)
    on(readonly).set_status(kestrel.Status.READ_ONLY)
    wait_until(lambda: produced >= total // 2, "half produced", timeout=30)
    flowing.clear()
    # Open reads of a consumer that dies with the server. Until the consumer blocks in `handle` it
    # may take the items in sight first, so take them as the producer keeps adding.
    holder = on(killed)
    held: list[Any] = []

    def hold_ten() -> bool:
        held.extend(holder.get("e2e", 10 - len(held), 0, 60_000))
        return len(held) == 10

    wait_until(hold_ten, "ten open reads on the server to kill")
    killed.kill()  # with unread items in its journal, open reads, maybe the consumer's too
    time.sleep(0.1)  # real time: down for a moment, the clients see connections refused
    killed.start()
    flowing.set()
    threads[0].join(60)
    assert not errors, errors
    wait_until(lambda: len(deliveries) == total, "every item delivered", timeout=30)
    stop.set()
    threads[1].join(10)
    assert not errors, errors
    assert set(deliveries) == {b"item-%05d" % i for i in range(total)}
    assert all(deliveries[item.data] for item in held)
    # The consumer drained every server, the read-only one and the restarted one included.
    for srv in cluster3:
        info = on(srv).peek("e2e")
        assert (info.items, info.open_transactions) == (0, 0), srv.thrift_port
    assert on(readonly).status() == kestrel.Status.READ_ONLY
    redelivered = sum(deliveries.values()) - total
    print(f"10,000 items: {redelivered} delivered twice (a lost confirm or a put resent after a kill)")
    on(readonly).set_status(kestrel.Status.UP)
    cluster.close()


def test_a_member_whose_data_is_no_member_leaves_the_sets_followed(zookeeper: Any, zk: KazooClient) -> None:
    """Member data of 100,000 `[` then as many `]` made reading it raise RecursionError: a new
    client's construction raised it (no KestrelClientError), and a running client's watch died with
    it, its lists frozen while the member lived. It is ignored, and a member joining later is seen."""
    prefix = "/kestrel-no-member"
    try:
        assert_followed_past(zookeeper, zk, prefix, lambda: join(zk, prefix, 0, b"[" * 100_000 + b"]" * 100_000))
    finally:
        zk.delete(prefix, recursive=True)


def assert_followed_past(zookeeper: Any, zk: KazooClient, prefix: str, add_member: Callable[[], None]) -> None:
    """A running client of the sets under `prefix` and a new one ignore the member `add_member` makes,
    and see the one that joins after it."""
    join(zk, prefix, 7001)
    with ZooKeeperServerSets(zookeeper.hosts, prefix) as running:
        wait_until(lambda: thrift_ports(running.writers()) == {7001}, "the first member")
        add_member()
        join(zk, prefix, 7002)
        wait_until(lambda: thrift_ports(running.writers()) == thrift_ports(running.readers()) == {7001, 7002},
                   "the member joined after it")
    with ZooKeeperServerSets(zookeeper.hosts, prefix) as fresh:
        assert thrift_ports(fresh.writers()) == thrift_ports(fresh.readers()) == {7001, 7002}


def test_a_member_this_client_may_not_read_leaves_the_sets_followed(zookeeper: Any, zk: KazooClient) -> None:
    """A member another service wrote under an ACL of its own made reading it raise NoAuthError: a new
    client's construction failed (ServerSetsUnavailable), and a running client watched again each
    second for good, its lists frozen. It is ignored, and a member joining later is seen."""
    from kazoo.security import make_digest_acl

    prefix = "/kestrel-unreadable"

    def unreadable_member() -> None:
        for name in ("write", "read"):
            zk.create(f"{prefix}/{name}/member_", member_on(7003), sequence=True,
                      acl=[make_digest_acl("other", "secret", all=True)])

    try:
        assert_followed_past(zookeeper, zk, prefix, unreadable_member)
    finally:
        zk.add_auth("digest", "other:secret")  # to list the unreadable members, and so delete them
        zk.delete(prefix, recursive=True)


def test_zookeeper_server_sets_under_gevent(zookeeper: Any, cluster3: list[ServerProcess]) -> None:
    max_gap, waited = run_gevent_script(f"zookeeper={zookeeper.hosts}{PREFIX}")
    assert waited >= 0.5 and max_gap < MAX_TICKER_GAP_S, (max_gap, waited)


def member_on(port: int, host: str = "127.0.0.1") -> bytes:
    """A server set member's data, as a server at `host`:`port` serving Thrift writes it."""
    return json.dumps({"serviceEndpoint": {"host": host, "port": port},
                       "additionalEndpoints": {"thrift": {"host": host, "port": port}},
                       "status": "ALIVE"}).encode()


def join(zk: KazooClient, prefix: str, port: int, data: bytes | None = None) -> None:
    """A member for 127.0.0.1:`port` (or of `data`) in both sets under `prefix`, as a server joins them."""
    for name in ("write", "read"):
        zk.create(f"{prefix}/{name}/member_", member_on(port) if data is None else data, sequence=True,
                  makepath=True)


def ignored_members(caplog: pytest.LogCaptureFixture) -> int:
    return sum("ignoring server set member" in r.getMessage() for r in caplog.records)


def test_a_running_client_ignores_a_member_advertising_an_address_no_call_could_use(
        zookeeper: Any, zk: KazooClient, cluster3: list[ServerProcess], caplog: pytest.LogCaptureFixture) -> None:
    """A member with port 0, 99999 or an empty host, written by another service into the sets a
    client watches, made every put and get of that client raise ValueError ("bad server address"),
    the real server unused. It is ignored with a warning, as malformed data is."""
    prefix = "/kestrel-bad-address"
    real = cluster3[0].thrift_port
    join(zk, prefix, real)
    try:
        with Cluster.from_zookeeper(zookeeper.hosts, prefix) as cluster:
            wait_until(lambda: thrift_ports(cluster.source.writers()) == {real}, "the real server")
            for port in (0, 99999):
                join(zk, prefix, port)
            join(zk, prefix, 0, member_on(2229, host=""))
            wait_until(lambda: ignored_members(caplog) >= 6, "the three members of each set ignored")
            assert thrift_ports(cluster.source.writers()) == thrift_ports(cluster.source.readers()) == {real}
            assert cluster.put("bad-address", b"x")
            assert cluster.get("bad-address") == b"x"
    finally:
        zk.delete(prefix, recursive=True)


@contextlib.contextmanager
def watching_one_member(zookeeper: Any, zk: KazooClient, prefix: str,
                        session_timeout: float) -> Iterator[ZooKeeperServerSets]:
    """A client of the sets under `prefix` once it sees their first member (7001) in both; closed
    after, and the sets deleted (`zk` started again if the test left it stopped)."""
    join(zk, prefix, 7001)
    watching = ZooKeeperServerSets(zookeeper.hosts, prefix, session_timeout=session_timeout)
    try:
        wait_until(lambda: thrift_ports(watching.writers()) == thrift_ports(watching.readers()) == {7001},
                   "the first member")
        yield watching
    finally:
        watching.close()
        if not zk.connected:
            zk.start(timeout=30)
        zk.delete(prefix, recursive=True)


def test_server_sets_survive_connection_loss_while_zookeeper_restarts(zookeeper: Any, zk: KazooClient) -> None:
    """A real restart, and ZooKeeper going away again while the client sets its watches once more:
    ConnectionLoss on every read of a set (made to happen here) until 15 have failed. The client
    keeps trying at least every few seconds (the pauses it asks for are recorded and cut short, not
    timed: kazoo's default doubles them up to an hour, which froze the lists that long), and sees a
    member that joins once ZooKeeper answers again."""
    from kazoo.exceptions import ConnectionLoss

    prefix = "/kestrel-watch-loss"
    with watching_one_member(zookeeper, zk, prefix, session_timeout=20.0) as watching:
        failing = threading.Event()
        failed = 0
        real_get_children = watching.zk.get_children
        pauses: list[float] = []

        def get_children(*args: Any, **kwargs: Any) -> Any:
            nonlocal failed
            if failing.is_set():
                failed += 1
                raise ConnectionLoss()
            return real_get_children(*args, **kwargs)

        def sleep(seconds: float) -> None:
            pauses.append(seconds)
            time.sleep(0.01)

        watching.zk.get_children = get_children  # type: ignore[method-assign]
        watching.zk._retry.sleep_func = sleep  # the pauses between tries of a call
        failing.set()
        zk.stop()
        zookeeper.restart(wipe=False)
        wait_until(lambda: failed >= 15, "the client's reads of the sets to fail after the restart")
        failing.clear()
        zk.start(timeout=30)
        join(zk, prefix, 7002)
        wait_until(lambda: thrift_ports(watching.writers()) == {7001, 7002}
                   and thrift_ports(watching.readers()) == {7001, 7002}, "the member joined after the restart")
        assert pauses and max(pauses) <= discovery.RETRY_MAX_DELAY_S * 1.4, pauses


SOCKETS_ONLY_SCRIPT = """
from gevent import monkey
monkey.patch_all(thread=False)
import sys, time
import gevent
from kestrel.client import ZooKeeperServerSets
hosts, prefix = sys.argv[1:]
sets = ZooKeeperServerSets(hosts, prefix, session_timeout=2.0)
def ports():
    return sorted(port for _, port in sets.writers())
deadline = time.monotonic() + 60
while ports() != [7001] and time.monotonic() < deadline:
    gevent.sleep(0.05)
print("watching", flush=True)
while ports() != [7001, 7002] and time.monotonic() < deadline:
    gevent.sleep(0.05)
print("followed" if ports() == [7001, 7002] else f"frozen at {ports()}", flush=True)
sets.close()
"""


def test_server_sets_under_gevent_with_sockets_patched_and_not_threads(zookeeper: Any, zk: KazooClient) -> None:
    """Where gevent had patched sockets and not threads, the session's renewal after an outage ran in a
    thread's timer, which could not touch kazoo's gevent client ("cannot switch to a different
    thread"): the client stayed disconnected and its lists froze for good (and a thread's lock held
    across ZooKeeper's calls could stall the whole hub). Its timers and that lock are kazoo handler's
    now: greenlets there."""
    prefix = "/kestrel-sockets-only"
    join(zk, prefix, 7001)
    script = subprocess.Popen([sys.executable, "-c", SOCKETS_ONLY_SCRIPT, zookeeper.hosts, prefix],
                              cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    try:
        assert script.stdout is not None and script.stdout.readline().strip() == "watching"
        zk.stop()
        zookeeper.stop()
        time.sleep(3.0)  # past the session timeout: the client starts a session afresh
        zookeeper.start()
        zk.start(timeout=30)
        join(zk, prefix, 7002)
        out, err = script.communicate(timeout=90)
        assert out.strip() == "followed", err[-3000:]
    finally:
        script.kill()
        if not zk.connected:
            zk.start(timeout=30)
        zk.delete(prefix, recursive=True)


def test_a_new_session_reads_every_member_afresh(zookeeper: Any, zk: KazooClient) -> None:
    """Member names are unique only within one life of a set's node: an ensemble restarted empty
    numbers its members from 0 again, so a name the client knew may be another server's once its
    new session connects. Here the name passes to another server while the client has no session."""
    prefix = "/kestrel-member-names"

    def name_member(port: int) -> None:
        for name in ("write", "read"):
            path = f"{prefix}/{name}/member_0000000000"
            if zk.exists(path):
                zk.delete(path)
            zk.create(path, member_on(port), makepath=True)

    name_member(7001)
    # A session timeout longer than the test: the new session is the one started below.
    watching = ZooKeeperServerSets(zookeeper.hosts, prefix, session_timeout=60.0)
    try:
        wait_until(lambda: thrift_ports(watching.writers()) == thrift_ports(watching.readers()) == {7001},
                   "the first member")
        watching.zk.stop()
        name_member(7002)
        watching.zk.start(timeout=30)
        wait_until(lambda: thrift_ports(watching.writers()) == thrift_ports(watching.readers()) == {7002},
                   "the server now holding the name")
    finally:
        watching.close()
        zk.delete(prefix, recursive=True)


def test_a_set_deleted_and_made_again_is_watched_again(zookeeper: Any, zk: KazooClient) -> None:
    """An operator's `deleteall` of a set while the client's session lives: kazoo ends a children
    watch for good when its node goes, without a word, so the client must watch the new node once
    the set is made again, and see the servers that join it."""
    prefix = "/kestrel-set-deleted"
    with watching_one_member(zookeeper, zk, prefix, session_timeout=60.0) as watching:
        zk.delete(f"{prefix}/write", recursive=True)
        wait_until(lambda: watching.writers() == [], "the deleted set to be empty")
        assert thrift_ports(watching.readers()) == {7001}
        zk.create(f"{prefix}/write/member_", member_on(7002), sequence=True, makepath=True)
        wait_until(lambda: thrift_ports(watching.writers()) == {7002}, "the member of the set made again")
        zk.create(f"{prefix}/write/member_", member_on(7003), sequence=True)
        wait_until(lambda: thrift_ports(watching.writers()) == {7002, 7003}, "a later member of that set")


def test_reconnections_keep_one_watch_per_set(zookeeper: Any, zk: KazooClient) -> None:
    """Each reconnection reads the sets afresh; with stable sets, kazoo's recipes (a data and a
    children watch per set, started at each connection) never ended, and each read its node again
    at every later connection: the reads there grew with the reconnections behind them, as did the
    session listeners. The client must hold one watch per node however often it reconnects, and
    still see a member that joins after the last reconnection."""
    prefix = "/kestrel-watch-reconnect"
    # A ZooKeeper just restarted may take a connection and never answer it: the client starts a new
    # session after a session timeout without one, well within the wait below.
    with watching_one_member(zookeeper, zk, prefix, session_timeout=20.0) as watching:
        listeners = len(watching.zk.state_listeners)
        reads: list[tuple[str, str]] = []  # (call, path) of each read that answered

        def recorded(call: str, read: Any) -> Any:
            def recording(path: str, *args: Any, **kwargs: Any) -> Any:
                result = read(path, *args, **kwargs)
                reads.append((call, path))
                return result
            return recording

        watching.zk.get = recorded("get", watching.zk.get)  # type: ignore[method-assign]
        watching.zk.get_children = recorded("get_children", watching.zk.get_children)  # type: ignore[method-assign]
        zk.stop()
        starts: list[int] = []  # where the reads that followed each reconnection begin
        for _ in range(4):
            starts.append(len(reads))
            zookeeper.restart(wipe=False)
            # Every member is read afresh at a reconnection, last of its reading of the sets.
            wait_until(lambda: {path.split("/")[2] for _, path in reads[starts[-1]:] if "/member_" in path}
                       == {"write", "read"}, "the members read again after the restart", timeout=60)
        assert len(watching.zk.state_listeners) == listeners
        at_each = [sorted(reads[begin:end]) for begin, end in zip(starts, [*starts[1:], len(reads)], strict=True)]
        assert at_each == [at_each[0]] * len(at_each), at_each
        zk.start(timeout=30)
        joined = len(reads)
        join(zk, prefix, 7002)
        wait_until(lambda: thrift_ports(watching.writers()) == thrift_ports(watching.readers()) == {7001, 7002},
                   "the member joined after the last restart")
        # Kazoo calls the watches of one event in turn, before those of the next: holding one watch
        # per set, the client reads each set's members once for that member and once for the next.
        join(zk, prefix, 7003)
        wait_until(lambda: thrift_ports(watching.writers()) == thrift_ports(watching.readers()) == {7001, 7002, 7003},
                   "the next member")
        members_read = Counter(path for call, path in reads[joined:] if call == "get_children")
        assert members_read == {f"{prefix}/write": 2, f"{prefix}/read": 2}, members_read
