"""ZooKeeper server sets: real ZooKeeper, real servers, membership read back with kazoo."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from pymemcache.client.base import Client as MemcacheClient

from kestrel.client import ZooKeeperServerSets
from kestrel.contract import kestrel_thrift as kestrel
from kestrel.service.config import ZooKeeperConfig, from_mapping, with_overrides
from kestrel.service.session.status import Status, StatusKeeper
from kestrel.service.zookeeper import ServerSetMembership, advertised_host, member_data, sets_for
from kestrel.storage.errors import ConfigError
from tests.conftest import STALL_S, ServerProcess, free_port, wait_until
from tests.support.clients import thrift_client
from tests.support.cluster import running_servers

SESSION_TIMEOUT = "1s"  # short, so that a killed server's session expires quickly
MEMBER_SESSION_TIMEOUT = "3s"  # the members whose sets follow their statuses


def zk_config(zookeeper: Any, prefix: str, **extra: Any) -> dict[str, Any]:
    return {"zookeeper": {"hosts": zookeeper.hosts, "path_prefix": prefix, "session_timeout": SESSION_TIMEOUT,
                          "advertise_host": "127.0.0.1", **extra}}


def members(zk: KazooClient, path: str) -> dict[int, dict[str, Any]]:
    """Members of one server set by their thrift port, as their JSON."""
    out = {}
    try:
        children = zk.get_children(path)
    except NoNodeError:
        return {}
    for child in children:
        try:
            data, _ = zk.get(f"{path}/{child}")
        except NoNodeError:
            continue
        member = json.loads(data)
        out[member["additionalEndpoints"]["thrift"]["port"]] = member
    return out


def set_ports(zk: KazooClient, prefix: str) -> tuple[set[int], set[int]]:
    return set(members(zk, f"{prefix}/write")), set(members(zk, f"{prefix}/read"))


def thrift(srv: ServerProcess) -> Any:
    return thrift_client(srv.thrift_port)


def set_status(srv: ServerProcess, status: int) -> None:
    client = thrift(srv)
    client.set_status(status)
    client.close()


MEMBERS = "/kestrel-members"
# Long enough that the checks made within it (the write set left, a put still taken) come before its end
# however loaded the machine.
GRACE_S = 3


@pytest.fixture(scope="module")
def members3(zookeeper: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Three members of MEMBERS; the third gives clients GRACE_S to stop writing before refusing."""
    # Sessions long enough that a loaded machine does not expire them (1 s ones did, and the members
    # left and rejoined the sets while the tests waited for a status change to show).
    member = zk_config(zookeeper, MEMBERS, session_timeout=MEMBER_SESSION_TIMEOUT)
    configs = [member, member, {**member, "status_change_grace_period": f"{GRACE_S}s"}]
    with running_servers(tmp_path_factory.mktemp("members"), configs) as servers:
        yield servers


def admin(srv: ServerProcess, path: str) -> tuple[int, str]:
    """The HTTP status and body of one admin-port page."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def admin_json(srv: ServerProcess) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(admin(srv, "/stats.json")[1])
    return body


def memcache_status(srv: ServerProcess, status: str) -> None:
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=5) as s:
        s.sendall(f"status {status}\r\n".encode())
        assert s.recv(100) == b"END\r\n"


# ---------------------------------------------------------------------------------------------
# Pure parts


def _accepts_a_put(mc: MemcacheClient) -> bool:
    """Whether the server takes a put now (to a queue of its own, so the test's queues stay as they are)."""
    try:
        return bool(mc.set("probe", b"p", noreply=False))
    except Exception as e:
        if "ReadOnly" not in str(e):
            raise
        return False


def test_member_json_default_endpoint_falls_back_memcache_thrift_text() -> None:
    both = json.loads(member_data("h", {"thrift": 2229, "memcache": 22133, "text": 2222, "admin": 2223}))
    assert both == {
        "serviceEndpoint": {"host": "h", "port": 22133},
        "additionalEndpoints": {"memcache": {"host": "h", "port": 22133}, "thrift": {"host": "h", "port": 2229},
                                "text": {"host": "h", "port": 2222}},
        "status": "ALIVE",
    }
    assert json.loads(member_data("h", {"thrift": 1, "text": 2}))["serviceEndpoint"] == {"host": "h", "port": 1}
    assert json.loads(member_data("h", {"text": 2}))["serviceEndpoint"] == {"host": "h", "port": 2}
    with pytest.raises(ValueError, match="no memcache, thrift or text"):
        member_data("h", {"admin": 3})


def test_advertised_host() -> None:
    config = ZooKeeperConfig("zk:2181")
    assert advertised_host(config, "10.0.0.5") == "10.0.0.5"
    assert advertised_host(config, "0.0.0.0") == socket.getfqdn()
    assert advertised_host(ZooKeeperConfig("zk:2181", advertise_host="kestrel1"), "0.0.0.0") == "kestrel1"


def test_status_decides_the_sets() -> None:
    assert sets_for(Status.UP) == ("read", "write")
    assert sets_for(Status.NOT_CONFIGURED) == ("read", "write")
    assert sets_for(Status.READ_ONLY) == ("read",)
    assert sets_for(Status.QUIESCENT) == ()


def test_zookeeper_config_and_its_errors() -> None:
    assert from_mapping({}).zookeeper is None
    config = from_mapping({"zookeeper": {"hosts": "zk1:2181,zk2:2181", "path_prefix": "/kestrel/prod/",
                                         "session_timeout": "4s"}}).zookeeper
    assert config == ZooKeeperConfig("zk1:2181,zk2:2181", "/kestrel/prod", 4000, None)
    for bad, key in [({"zookeeper": {"path_prefix": "/k"}}, "zookeeper.hosts"),
                     ({"zookeeper": {"hosts": "zk:2181", "path_prefix": "kestrel"}}, "zookeeper.path_prefix"),
                     ({"zookeeper": {"hosts": "zk:2181", "session_timeout": "soon"}}, "zookeeper.session_timeout"),
                     ({"zookeeper": {"hosts": "zk:2181", "port": 2181}}, "zookeeper.port"),
                     ({"zookeeper": "zk:2181"}, "zookeeper")]:
        with pytest.raises(ConfigError) as e:
            from_mapping(bad)
        assert e.value.key == key


@pytest.mark.parametrize("setting, value, reason", [
    # what kazoo refuses once the membership starts: it died with "relative paths not allowed"
    ("path_prefix", "/a/./b", "relative paths not allowed"), ("path_prefix", "/a/../b", "relative paths"),
    ("path_prefix", "/kestrel\x00", "refuses the character"), ("path_prefix", "/k\x7f", "refuses the character"),
    # what kazoo refused as the server started, with a traceback and exit code 1
    ("hosts", "localhost:99999", "Port out of range"), ("hosts", "a:b:c:d", "expected host:port"),
    ("hosts", "zk:2181/a/../b", "relative paths"), ("hosts", " ", "expected the ZooKeeper ensemble"),
])
def test_zookeeper_settings_are_judged_by_the_rules_that_read_them(setting: str, value: str, reason: str) -> None:
    settings = {"hosts": "zk:2181", setting: value}
    with pytest.raises(ConfigError) as e:
        from_mapping({"zookeeper": settings})
    assert e.value.key == f"zookeeper.{setting}" and reason in str(e.value)
    with pytest.raises(ValueError, match=f"ZooKeeperServerSets: {setting}: .*{re.escape(reason)}"):
        ZooKeeperServerSets(settings["hosts"], settings.get("path_prefix", "/kestrel"))
    assert from_mapping({"zookeeper": {"hosts": "zk1:2181,[::1]:2181/chroot", "path_prefix": "/a.b/c-d_"}})


def test_server_sets_need_a_queue_listener_to_advertise() -> None:
    """A server with every queue port off has nothing to put in a member: refused as a setting, where
    it started and then exited with a traceback."""
    off = {"thrift_port": 0, "memcache_port": 0, "text_port": 0}
    with pytest.raises(ConfigError, match="no queue listener to advertise") as e:
        from_mapping({"zookeeper": {"hosts": "zk:2181"}, **off})
    assert e.value.key == "zookeeper"
    with pytest.raises(ConfigError, match="memcache_port, --thrift-port and text_port are all 0"):
        with_overrides(from_mapping({"zookeeper": {"hosts": "zk:2181"}, "memcache_port": 0, "text_port": 0}),
                       thrift_port=0)
    assert from_mapping({"zookeeper": {"hosts": "zk:2181"}, **off, "text_port": 2222}).zookeeper


# ---------------------------------------------------------------------------------------------
# Real ZooKeeper, real servers


def test_members_follow_status_from_every_protocol(zk: KazooClient, members3: list[ServerProcess]) -> None:
    prefix = MEMBERS
    servers = members3
    ports = {s.thrift_port for s in servers}
    wait_until(lambda: set_ports(zk, prefix) == (ports, ports), "three members in both sets")

    # Each member: an ephemeral sequential member_ znode in the exact ServerSet JSON.
    for name in ("write", "read"):
        for child in zk.get_children(f"{prefix}/{name}"):
            assert child.startswith("member_") and child[7:].isdigit() and len(child) == 17
            data, stat = zk.get(f"{prefix}/{name}/{child}")
            assert stat.ephemeralOwner != 0
        for srv in servers:
            assert members(zk, f"{prefix}/{name}")[srv.thrift_port] == {
                "serviceEndpoint": {"host": "127.0.0.1", "port": srv.memcache_port},
                "additionalEndpoints": {
                    "memcache": {"host": "127.0.0.1", "port": srv.memcache_port},
                    "thrift": {"host": "127.0.0.1", "port": srv.thrift_port},
                    "text": {"host": "127.0.0.1", "port": srv.text_port},
                },
                "status": "ALIVE",
            }

    a, b, c = servers
    # ReadOnly over memcache: out of the write set, still in the read set.
    memcache_status(a, "readonly")
    wait_until(lambda: set_ports(zk, prefix) == (ports - {a.thrift_port}, ports), "a to leave the write set")
    # The admin port says so: the status and the membership in /stats.json and /metrics.
    wait_until(lambda: admin_json(a)["server_sets"] == {"connected": True, "read": True, "write": False},
               "a's membership in /stats.json")
    assert admin_json(a)["status"] == "ReadOnly"
    metrics = admin(a, "/metrics")[1]
    assert 'kestrel_server_set_member{set="read"} 1.0' in metrics
    assert 'kestrel_server_set_member{set="write"} 0.0' in metrics
    assert "kestrel_zookeeper_connected 1.0" in metrics and 'kestrel_status{status="ReadOnly"} 1.0' in metrics
    # Quiescent over Thrift: out of both.
    client = thrift(b)
    client.set_status(kestrel.Status.QUIESCENT)
    wait_until(lambda: set_ports(zk, prefix) == ({c.thrift_port}, {a.thrift_port, c.thrift_port}),
               "b to leave both sets")
    # Back to Up over Thrift: in both again, as a new member.
    client.set_status(kestrel.Status.UP)
    client.close()
    wait_until(lambda: set_ports(zk, prefix) == ({b.thrift_port, c.thrift_port}, ports), "b to rejoin")

    # With a grace period, the write set is left at once and puts are refused only after it.
    mc = MemcacheClient(("127.0.0.1", c.memcache_port), timeout=5)
    for _ in range(5):  # until the checks made within the grace period ended within it (a loaded machine)
        changed = time.monotonic()
        memcache_status(c, "readonly")
        try:
            wait_until(lambda: c.thrift_port not in set_ports(zk, prefix)[0], "c to leave the write set",
                       timeout=GRACE_S)
            assert mc.set("jobs", b"still accepted", noreply=False)
            # Load balancers see it at once too, as the write set does.
            assert admin(c, "/ready") == (503, "ReadOnly\n") and admin(c, "/ready/read") == (200, "ReadOnly\n")
            assert (admin_json(c)["status"], admin_json(c)["enforced_status"]) == ("ReadOnly", "Up")
        except Exception:
            if time.monotonic() - changed < GRACE_S:
                raise  # wrong within the grace period
        else:
            if time.monotonic() - changed < GRACE_S:
                break
        memcache_status(c, "up")  # the grace period ran out first: again, from Up
        wait_until(lambda: c.thrift_port in set_ports(zk, prefix)[0] and _accepts_a_put(mc), "c to be Up again")
    else:
        pytest.fail("the grace period ran out before its checks ended, five times")
    wait_until(lambda: not _accepts_a_put(mc), "puts to be refused once the grace period ends")
    assert time.monotonic() - changed >= GRACE_S, "puts were refused before the grace period ran out"
    with pytest.raises(Exception, match="ReadOnly"):
        mc.set("jobs", b"refused", noreply=False)
    mc.close()
    assert "joined server set" in a.log() and "left server set" in a.log()


def test_killed_server_leaves_when_its_session_expires_and_shutdown_leaves_at_once(
        zookeeper: Any, zk: KazooClient, server_factory: Any) -> None:
    prefix = "/kestrel-expiry"
    killed = server_factory(zk_config(zookeeper, prefix), name="killed")
    stopped = server_factory(zk_config(zookeeper, prefix, session_timeout="30s"), name="stopped")
    both = {killed.thrift_port, stopped.thrift_port}
    wait_until(lambda: set_ports(zk, prefix) == (both, both), "both members")
    killed.kill()
    took = wait_until(lambda: killed.thrift_port not in set_ports(zk, prefix)[1], "the killed one to expire")
    assert took < 8, took  # its 1 s session, not a default one of 10 s
    # A clean shutdown leaves the sets itself, long before a 30 s session would expire.
    stopped.stop()
    assert set_ports(zk, prefix) == (set(), set())


def test_zookeeper_restart_reregisters_everyone(zookeeper: Any, members3: list[ServerProcess]) -> None:
    prefix = MEMBERS
    servers = members3
    for srv, status in zip(servers, (kestrel.Status.READ_ONLY, kestrel.Status.UP, kestrel.Status.UP), strict=True):
        set_status(srv, status)
    ports = {s.thrift_port for s in servers}
    writers = ports - {servers[0].thrift_port}
    watching = ZooKeeperServerSets(zookeeper.hosts, MEMBERS, session_timeout=1.0)  # a client's view
    zk = KazooClient(hosts=zookeeper.hosts, timeout=5)
    zk.start(timeout=10)
    try:
        wait_until(lambda: set_ports(zk, prefix) == (writers, ports), "members before the restart")
    finally:
        zk.stop()
        zk.close()

    # Restarted with its data, ZooKeeper resumes the sessions: the members stay, and follow statuses.
    zookeeper.restart(wipe=False)
    set_status(servers[0], kestrel.Status.UP)
    zk = KazooClient(hosts=zookeeper.hosts, timeout=5)
    zk.start(timeout=10)
    try:
        wait_until(lambda: set_ports(zk, prefix) == (ports, ports), "members after a restart with data")
    finally:
        zk.stop()
        zk.close()
    set_status(servers[0], kestrel.Status.READ_ONLY)

    # Down for longer than a session timeout: each server starts a new session meanwhile, and on
    # rejoining removes its member of the old one, which the restarted ensemble still holds.
    gave_up = "no zookeeper connection for a session timeout"
    before = [srv.log().count(gave_up) for srv in servers]
    zookeeper.stop()
    wait_until(lambda: all(srv.log().count(gave_up) > n for srv, n in zip(servers, before, strict=True)),
               "every server to give up its session while ZooKeeper is down")
    zookeeper.start()
    zk = KazooClient(hosts=zookeeper.hosts, timeout=5)
    zk.start(timeout=10)
    try:
        def one_member_each() -> bool:
            counts = [len(zk.get_children(f"{prefix}/{name}")) for name in ("write", "read")]
            return counts == [2, 3] and set_ports(zk, prefix) == (writers, ports)
        wait_until(one_member_each, "one member per server after a long outage")
    finally:
        zk.stop()
        zk.close()

    # Restarted empty (a rebuilt ensemble), it refuses the old sessions: every server starts a new one.
    zookeeper.restart(wipe=True)
    zk = KazooClient(hosts=zookeeper.hosts, timeout=5)
    zk.start(timeout=10)
    try:
        took = wait_until(lambda: set_ports(zk, prefix) == (writers, ports), "members after the restart")
        assert took < 8, took
    finally:
        zk.stop()
        zk.close()
    assert "zookeeper session lost" in servers[1].log()
    # The client's watches came back too: it sees a change made after the restart.
    set_status(servers[0], kestrel.Status.UP)
    wait_until(lambda: {port for _, port in watching.writers()} == ports, "the client to see the change")
    watching.close()


def test_joining_removes_our_member_left_by_an_earlier_session(zookeeper: Any, zk: KazooClient) -> None:
    """A member with exactly our endpoints from another session is ours, from before: it goes."""
    prefix = "/kestrel-claim"
    zk.ensure_path(f"{prefix}/read")
    stale = zk.create(f"{prefix}/read/member_", member_data("127.0.0.1", {"thrift": 1234}), ephemeral=True,
                      sequence=True)
    neighbour = zk.create(f"{prefix}/read/member_", member_data("127.0.0.1", {"thrift": 4321}),
                          ephemeral=True, sequence=True)
    config = ZooKeeperConfig(zookeeper.hosts, prefix, 1000, "127.0.0.1")
    membership = ServerSetMembership(config, {"thrift": 1234}, "127.0.0.1", StatusKeeper(None, Status.UP, 0))
    membership.start()
    try:
        def joined() -> bool:
            gevent.sleep(0.02)  # the membership works in greenlets of this process
            return set(membership.members) == {"read", "write"}
        wait_until(joined, "the membership to join")
        children = {f"{prefix}/read/{c}" for c in zk.get_children(f"{prefix}/read")}
        assert children == {neighbour, membership.members["read"]} and stale not in children
    finally:
        membership.stop()
    assert zk.get_children(f"{prefix}/read") == [neighbour.rsplit("/", 1)[1]]


def test_serving_never_waits_for_zookeeper(zookeeper: Any, zk: KazooClient, server_factory: Any) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    srv = server_factory({"zookeeper": {"hosts": nobody, "path_prefix": "/kestrel-down", "session_timeout": "1s"}})
    client = thrift(srv)
    started = time.monotonic()
    for i in range(50):
        assert client.put("jobs", [b"%d" % i], 0) == 1
    assert [item.data for item in client.get("jobs", 100, 0, 0)] == [b"%d" % i for i in range(50)]
    client.set_status(kestrel.Status.READ_ONLY)
    client.set_status(kestrel.Status.UP)
    assert time.monotonic() - started < STALL_S  # not a session timeout (1 s) a call, 50 of them
    client.close()
    assert srv.proc is not None and srv.proc.poll() is None


def lone_membership(zookeeper: Any, prefix: str, tmp_path: Any) -> tuple[ServerSetMembership, StatusKeeper]:
    """A membership of its own in this process, Up, with a session longer than its test: what rejoins
    is a deletion's doing, not a periodic check's."""
    config = ZooKeeperConfig(zookeeper.hosts, prefix, 600_000, "127.0.0.1")
    status = StatusKeeper(str(tmp_path / "status"), Status.UP, 0)
    return ServerSetMembership(config, {"thrift": 1234}, "127.0.0.1", status), status


def in_sets(zk: KazooClient, prefix: str, write: int, read: int) -> bool:
    """Whether the sets hold that many members (any of them ours: nobody else joins them)."""
    gevent.sleep(0.02)  # the membership works in greenlets of this process
    return tuple(len(zk.get_children(f"{prefix}/{name}")) if zk.exists(f"{prefix}/{name}") else 0
                 for name in ("write", "read")) == (write, read)


def test_a_member_deleted_from_outside_joins_again(zookeeper: Any, zk: KazooClient, tmp_path: Any) -> None:
    """A member deleted by hand while the session lives is made again at once (not at the next status
    change or session), once: never two members for one server, and none in a set its status leaves."""
    prefix = "/kestrel-member-deleted"
    membership, status = lone_membership(zookeeper, prefix, tmp_path)
    membership.start()
    try:
        wait_until(lambda: in_sets(zk, prefix, 1, 1) and set(membership.members) == {"read", "write"}, "the membership to join")
        first = membership.members["write"]
        zk.delete(first)
        # (between the new member's creation and its reply, the membership has no write member yet)
        wait_until(lambda: in_sets(zk, prefix, 1, 1) and membership.members.get("write") not in (None, first),
                   "the member made again")
        status.set(Status.READ_ONLY)
        wait_until(lambda: in_sets(zk, prefix, 0, 1), "the write set left")
        zk.delete(membership.members["read"])
        wait_until(lambda: in_sets(zk, prefix, 0, 1) and "write" not in membership.members, "the read member made again")
    finally:
        membership.stop()
    assert (zk.get_children(f"{prefix}/write"), zk.get_children(f"{prefix}/read")) == ([], [])


def test_a_member_deleted_before_it_is_watched_joins_again(zookeeper: Any, zk: KazooClient, tmp_path: Any) -> None:
    """A member deleted between its creation and the watch set on it (a hand racing the join) is made
    again too: the watch finds it gone."""
    prefix = "/kestrel-member-deleted-early"
    membership, _ = lone_membership(zookeeper, prefix, tmp_path)
    create = membership.zk.create
    deleted: list[str] = []

    def create_then_delete(*args: Any, **kwargs: Any) -> str:
        path: str = create(*args, **kwargs)
        if not deleted and f"{prefix}/write/" in path:
            zk.delete(path)  # before the membership has the reply, so before it watches the member
            deleted.append(path)
        return path

    membership.zk.create = create_then_delete  # type: ignore[method-assign]
    membership.start()
    try:
        wait_until(lambda: in_sets(zk, prefix, 1, 1) and membership.members.get("write") not in (None, *deleted),
                   "the member made again")
    finally:
        membership.stop()
    assert len(deleted) == 1


def test_an_unexpected_failure_of_a_membership_change_is_retried(zookeeper: Any, zk: KazooClient,
                                                                 tmp_path: Any) -> None:
    """A change that fails with neither kazoo's error nor a time-out (a path kazoo refused once
    ended it so) ended the membership's greenlet: the server served on and never joined a set."""
    prefix = "/kestrel-unexpected"
    membership, _ = lone_membership(zookeeper, prefix, tmp_path)
    reconcile = membership._reconcile
    failures: list[int] = []

    def fail_once() -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("a fault of ours")
        reconcile()

    membership._reconcile = fail_once  # type: ignore[method-assign]
    membership.start()
    try:
        wait_until(lambda: in_sets(zk, prefix, 1, 1) and set(membership.members) == {"read", "write"},
                   "the membership to join after its failure")
        assert failures == [1]
    finally:
        membership.stop()
