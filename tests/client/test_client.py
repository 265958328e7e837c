"""The cluster client over a static server list: spreading, retries, gets, reliable reads, concurrency."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kestrel.client.server as server_module
from kestrel.client import (
    ClientClosed,
    Cluster,
    KestrelClientError,
    NoServers,
    PackedItems,
    Refused,
    Server,
    ServerUnavailable,
    StaticServers,
    parse_address,
)
from kestrel.contract import kestrel_thrift as kestrel
from tests.conftest import PACKAGE_ROOT, ROOT, STALL_S, ServerProcess, free_port, wait_until
from tests.support.client_retries import Retries, recorded_retries  # noqa: F401  (the `retries` fixture)
from tests.support.cluster import MAX_TICKER_GAP_S, hung_servers, run_gevent_script, running_servers
from tests.support.wire import memcache_stats


def cluster_of(*servers: ServerProcess, **options: Any) -> Cluster:
    return Cluster([f"127.0.0.1:{s.thrift_port}" for s in servers], **options)


def on(srv: ServerProcess) -> Server:
    return Server("127.0.0.1", srv.thrift_port)


def items_on(srv: ServerProcess, queue: str) -> int:
    server = on(srv)
    try:
        return int(server.peek(queue).items)
    finally:
        server.close()


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Three servers shared by this module's tests, which keep apart by queue name."""
    small = {"queues": {"tiny": {"max_items": 5}}}
    with running_servers(tmp_path_factory.mktemp("client"), [{}, small, {}]) as servers:
        yield servers


@pytest.fixture
def server(three: list[ServerProcess]) -> ServerProcess:
    return three[0]


def _printed_by(code: str) -> str:
    """What `code` prints, run by a Python of its own with the package on its path (it must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_client_imports_without_the_server_code() -> None:
    code = ("import sys\n"
            "sys.modules['kestrel.service'] = sys.modules['kestrel.storage'] = None\n"
            "sys.modules['kestrel.pipeline'] = None\n"
            "import kestrel.client\n"
            "print(sorted(m for m in sys.modules if m.split('.')[1:2] in (['service'], ['storage']) and sys.modules[m]))\n")
    assert _printed_by(code).strip() == "[]"


def test_asking_whether_gevent_patched_sockets_imports_no_gevent() -> None:
    """Whether the client cooperates with gevent is asked at every connect opened ahead: asking
    imported gevent into processes that never used it (a Spark worker, whose collections walk every
    object it holds, gained some 800 of them)."""
    code = ("import sys\n"
            "from kestrel.client.cooperation import gevent_sockets\n"
            "print(gevent_sockets(), sorted(m for m in sys.modules if m.split('.')[0] == 'gevent'))\n"
            "from gevent import monkey\n"
            "monkey.patch_socket()\n"
            "print(gevent_sockets())\n")
    printed = _printed_by(code)
    assert printed.split("\n")[:2] == ["False []", "True"], printed


def test_addresses() -> None:
    assert parse_address("kestrel1:2230") == ("kestrel1", 2230)
    assert parse_address("kestrel1") == ("kestrel1", 2229)
    for bad in ("kestrel1:http", ":2229", "k:0"):
        with pytest.raises(ValueError, match="bad server address"):
            parse_address(bad)
    with pytest.raises(ValueError, match="no servers"):
        StaticServers([])
    assert StaticServers([("k", 1), ("k", "2"), "k:3"]).servers == [("k", 1), ("k", 2), ("k", 3)]
    with pytest.raises(TypeError, match=r"not one string: \['localhost'\]"):
        Cluster("localhost")  # type: ignore[arg-type]  # (iterated: nine servers of one letter)
    for wrong, error in ((("k", 99999), ValueError), (("k", "x"), ValueError), (None, TypeError),
                         ((1, 2), TypeError), (("", 1), ValueError), (("k", True), ValueError)):
        with pytest.raises(error, match="bad server address"):  # named before any connection is tried
            StaticServers([wrong])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="strategy"):
        Cluster(["k:1"], strategy="sticky")


def test_puts_spread_round_robin_and_random(three: list[ServerProcess]) -> None:
    cluster = cluster_of(*three)
    for i in range(30):
        assert cluster.put("rr", b"%d" % i)
    assert [items_on(s, "rr") for s in three] == [10, 10, 10]
    for _ in range(20):
        assert cluster.put_many("batches", [b"a", b"b"]) == 2
    assert [items_on(s, "batches") for s in three] in ([14, 14, 12], [14, 12, 14], [12, 14, 14])
    randomly = cluster_of(*three, strategy="random")
    for i in range(300):
        randomly.put("random", b"%d" % i)
    assert all(40 < items_on(s, "random") < 160 for s in three)
    cluster.close()
    randomly.close()


def test_puts_and_gets_of_one_cluster_each_go_round_the_servers(three: list[ServerProcess]) -> None:
    """A producer and a consumer sharing one Cluster: puts and gets took turns from one counter, so
    with two servers, each put alternating with a get, every put went to the first and every get
    began at the second."""
    first, _, last = three
    for srv in (first, last):
        one = on(srv)
        one.put("interleaved-gets", [b"waiting"] * 20)
        one.close()
    with cluster_of(first, last) as cluster:
        for i in range(20):
            assert cluster.put("interleaved-puts", b"%d" % i)
            assert cluster.get("interleaved-gets") == b"waiting"
    assert [items_on(s, "interleaved-puts") for s in (first, last)] == [10, 10]
    assert [items_on(s, "interleaved-gets") for s in (first, last)] == [10, 10]


def laid_out(items: list[bytes]) -> bytes:
    """Items as Thrift's list<binary> carries them: each a 4-byte big-endian length, then its bytes."""
    return b"".join(struct.pack(">i", len(item)) + item for item in items)


def test_packed_items_are_the_put_thriftpy2_sends() -> None:
    """A put of items laid out already is, byte for byte, the framed call thriftpy2 makes of a list,
    and cutting it after k items leaves the items a list would leave."""
    from thriftpy2.protocol.cybin import TCyBinaryProtocol
    from thriftpy2.transport import TCyMemoryBuffer

    items = [b"", b"a", b"\x00" * 300, bytes(range(256)), "é".encode()] * 3
    packed = PackedItems(laid_out(items), len(items))
    encoded = TCyMemoryBuffer()
    protocol = TCyBinaryProtocol(encoded)
    protocol.write_message_begin("put", 1, 0)  # a CALL, sequence id 0: thriftpy2's client
    kestrel.Kestrel.put_args(queue_name="jobs-é", items=items, expiration_msec=1500).write(protocol)
    protocol.write_message_end()
    call = encoded.getvalue()
    assert b"".join(packed.put_call("jobs-é", 1500)) == struct.pack(">i", len(call)) + call
    for k in range(len(items) + 2):
        rest = packed[k:]
        assert (len(rest), bytes(rest.body)) == (len(items[k:]), laid_out(items[k:]))
    with pytest.raises(ValueError, match=r"only be cut as \[first:\]"):
        packed[1:3]


def test_packed_items_move_on_from_a_full_server_in_order(three: list[ServerProcess], server_factory: Any) -> None:
    """A put of PackedItems is a put like any other: what a full queue refuses goes to the next
    server, from the first item it did not take."""
    small, roomy = server_factory({"queues": {"few": {"max_items": 5}}}), three[2]
    items = [b"packed %d" % i + b"!" * i for i in range(12)]
    with cluster_of(small, roomy) as cluster:
        assert cluster.put_many("few", PackedItems(laid_out(items), len(items))) == 12
    with on(small) as first, on(roomy) as second:
        got = [i.data for i in first.get("few", 20)], [i.data for i in second.get("few", 20)]
    assert got == (items[:5], items[5:])


def test_put_moves_on_from_dead_refusing_and_full_servers(three: list[ServerProcess]) -> None:
    readonly, small, roomy = three
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    on(readonly).set_status(kestrel.Status.READ_ONLY)
    try:
        cluster = Cluster([dead, *(f"127.0.0.1:{s.thrift_port}" for s in (readonly, small, roomy))])
        for _ in range(4):
            assert cluster.put_many("tiny", [b"x"] * 10) == 10
        # `tiny` holds 5 items: the small server's filled, the rest went to the roomy one.
        assert [items_on(s, "tiny") for s in three] == [0, 5, 35]
        # The dead server is tried last while it stays down: puts do not wait on it.
        started = time.monotonic()
        for _ in range(20):
            assert cluster.put("moves", b"y")
        assert time.monotonic() - started < STALL_S
        # When every queue is full, put says so.
        assert not Cluster([f"127.0.0.1:{small.thrift_port}"]).put("tiny", b"no room")
        cluster.close()
    finally:
        on(readonly).set_status(kestrel.Status.UP)


def counted_connections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The address of each connection the client tries to open from now on (a try of a server)."""
    tried: list[str] = []

    class Counted(server_module._Connection):
        def __init__(self, host: str, port: int, *args: Any) -> None:
            tried.append(f"{host}:{port}")
            super().__init__(host, port, *args)

    monkeypatch.setattr(server_module, "_Connection", Counted)
    return tried


def test_reads_left_to_their_auto_abort_free_their_connection_once_it_has_run(
        server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """`get` lets open reads be left to the server's auto-abort; they held their connection for
    good: every later reliable get opened a connection of its own, and the client kept every id."""
    one = on(server)
    one.put("left", [b"%d" % i for i in range(40)])
    tried = counted_connections(monkeypatch)
    for _ in range(4):
        assert len(one.get("left", 1, 0, 300)) == 1
    assert len(tried) == 3  # the put's connection, then one each: the pooled ones hold a read not yet returned
    for _ in range(3):
        time.sleep(0.4)  # their auto-abort has run
        for _ in range(4):
            assert len(one.get("left", 1, 0, 300)) == 1
    assert len(tried) == 3 and len(one._opened_on) <= 4
    one.close()


@pytest.mark.parametrize("call", ["put", "get"])
@pytest.mark.parametrize("silence", ["never accepts", "never answers"])
def test_a_server_that_hangs_is_avoided_longer_than_a_try_of_it_costs(
        server: ServerProcess, silence: str, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A try of a server whose listener never accepts costs the connect timeout (a partitioned host),
    one of a server that never answers the call's timeout (a frozen one); after it the server was
    avoided for `retry_after`, a second, which had run out by the time a producer came back to it
    (with the default 2 s connect timeout two puts in three stalled). Here the hung server has no
    `retry_after` of its own, so that only what its tries cost keeps it avoided, and timeouts of a
    tenth of the defaults: it is tried a few times in 40 puts, not at every other one. A get round
    asked every reader, the avoided last, and so waited out the hung one's timeout at every get."""
    tried = counted_connections(monkeypatch)
    with hung_servers(1, silence) as (hung,), Cluster([hung, f"127.0.0.1:{server.thrift_port}"]) as cluster:
        silent = cluster.server(hung)
        silent.retry_after, silent.connect_timeout_ms, silent.timeout_ms = 0.0, 200, 200
        for i in range(40):
            if call == "put":
                assert cluster.put("hung", b"%d" % i)
            else:
                assert cluster.get("hung-empty") is None
    assert 1 <= tried.count(hung) <= 4, tried.count(hung)


@pytest.mark.parametrize("call", ["put", "get"])
@pytest.mark.parametrize("silence", ["never accepts", "never answers"])
def test_a_call_whose_every_server_hangs_fails_at_once_until_one_is_due_again(
        silence: str, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every server is avoided after a try that cost a timeout, a call asks none of them: it
    raises NoServers after its retries' pauses alone, saying how long each stays avoided and why. A call asked every avoided
    server again, on each of its passes, and so waited out every hung server's timeout three times
    at every put or get. When an avoidance ends, the next call asks that server again."""
    tried = counted_connections(monkeypatch)
    with hung_servers(2, silence) as hung, Cluster(hung, connect_timeout_ms=150, timeout_ms=150,
                                                   backoff_ms=1) as cluster:
        for address in hung:
            cluster.server(address).retry_after = 0.0  # avoided for ten times what a try cost: 1.5 s
        do: Callable[[], object] = (lambda: cluster.put("hung", b"x")) if call == "put" \
            else (lambda: cluster.get("hung"))
        with pytest.raises(NoServers):
            do()  # tries each, and finds them hung
        assert sorted(set(tried)) == sorted(hung)
        first = len(tried)
        started = time.monotonic()
        for _ in range(10):
            with pytest.raises(NoServers, match="not asked, avoided .* s more after a try that cost") as e:
                do()
            assert sorted(err.address for err in e.value.errors) == sorted(hung)
        assert len(tried) == first, tried  # none tried again: each call failed at once
        assert time.monotonic() - started < 1.0  # 10 calls; each waited 0.9 s or more before
        # Its retries' pauses it still waits (backoff 100 ms, then 200, each at least half), so that
        # a loop calling again at once on NoServers does not spin; it asks none meanwhile.
        cluster.backoff_ms = 100
        started = time.monotonic()
        with pytest.raises(NoServers, match="not asked, avoided"):
            do()
        assert time.monotonic() - started >= 0.15 and len(tried) == first
        wait_until(lambda: not any(cluster.server(a).seems_down for a in hung), "the avoidance to end")
        with pytest.raises(NoServers):
            do()
        assert len(tried) > first  # asked again, once due


# How long a hung server's connect is held back while the call under test is to go on without it: a
# deadline that a call waiting on that connect meets, and one that waits on the live server never does.
HELD_CONNECT_S = 30.0


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_call_meeting_many_servers_that_never_accept_takes_the_first_server_that_connects(
        server: ServerProcess, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call to meet hung servers (their connects time out) before a live one waited out
    each one's connect timeout in turn, six here: 4.8 s. Their connects were then begun side by
    side, each a share of the timeout after the one before, but the pass still waited on each hung
    one at hand in turn: 1.7 timeouts. It now calls the live server once its connect (begun within
    one timeout) opens, and leaves the hung ones connecting: each is found hung when its connect
    ends, and the calls meanwhile join those connects rather than trying the servers again.

    The hung ones' connects are held back until the calls have returned (then connect, and time
    out, as ever): a call that waited on any of them would wait out HELD_CONNECT_S, and say so."""
    live = f"127.0.0.1:{server.thrift_port}"
    release = threading.Event()  # set once the calls are done
    waited_out: list[str] = []  # hung connects whose hold a call outwaited

    class Held(server_module._Connection):
        def __init__(self, host: str, port: int, *args: Any) -> None:
            if f"{host}:{port}" != live and not release.wait(HELD_CONNECT_S):
                waited_out.append(f"{host}:{port}")
            super().__init__(host, port, *args)

    monkeypatch.setattr(server_module, "_Connection", Held)
    tried = counted_connections(monkeypatch)  # counted as they begin, before the hold
    connecting, most = [0], [0]
    lock = threading.Lock()

    class Overlapping(server_module._Connection):  # the counting one
        def __init__(self, host: str, port: int, *args: Any) -> None:
            with lock:
                connecting[0] += 1
                most[0] = max(most[0], connecting[0])
            try:
                super().__init__(host, port, *args)
            finally:
                with lock:
                    connecting[0] -= 1

    monkeypatch.setattr(server_module, "_Connection", Overlapping)
    with hung_servers(6, "never accepts") as hung, Cluster([*hung, live], connect_timeout_ms=2000) as cluster:
        do: Callable[[], object] = (lambda: cluster.put("side-by-side", b"x")) if call == "put" \
            else (lambda: cluster.get("side-by-side-empty"))
        try:
            assert do() in (True, None)
            assert waited_out == []  # the pass waited on a hung connect before
            assert sorted(a for a in tried if a != live) == sorted(hung)  # each tried once
            assert most[0] >= 2, most  # one connect at a time before
            for _ in range(10):  # while the hung ones still connect
                assert do() in (True, None)
            assert waited_out == []
            assert sorted(a for a in tried if a != live) == sorted(hung)  # none tried again: joined
        finally:
            release.set()
        wait_until(lambda: all(cluster.server(a).still_hung() for a in hung), "every hung one found hung")
        wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("kestrel-connect-")],
                   "every connect opened ahead to end")
        for _ in range(10):
            assert do() in (True, None)
        assert sorted(a for a in tried if a != live) == sorted(hung)  # none tried again: skipped


# A program under gevent, its sockets alone patched or everything: a put and a get of a Cluster whose
# first servers never accept, their connects begun, and the live server's opened ahead beside them;
# then puts of greenlets side by side while those connects are under way. The hung servers' connects
# are held back until those puts are done (then connect, and time out, as ever). Prints how many of
# them a put outwaited the hold of (HELD_CONNECT_S) and the most connects any hung server had.
GEVENT_AHEAD_SCRIPT = """
import sys
from gevent import monkey
monkey.patch_socket() if sys.argv[1] == "sockets" else monkey.patch_all()
import gevent
import gevent.event
import kestrel.client.server as server_module
from kestrel.client import Cluster
held_s = float(sys.argv[2])
*hung, live = sys.argv[3:]
tried, waited_out = [], []
release = gevent.event.Event()
class Counted(server_module._Connection):
    def __init__(self, host, port, *args):
        tried.append(port)
        if f"{host}:{port}" != live and not release.wait(held_s):
            waited_out.append(port)
        super().__init__(host, port, *args)
server_module._Connection = Counted
queue = "ahead-" + sys.argv[1]
with Cluster([*hung, live], connect_timeout_ms=2000) as cluster:
    try:
        assert cluster.put(queue, b"x")
        gevent.joinall([gevent.spawn(cluster.put, queue, b"y") for _ in range(5)], raise_error=True)
        outwaited = len(waited_out)
    finally:
        release.set()
    assert cluster.get(queue) == b"x"
print("ok", outwaited, max(tried.count(int(address.split(":")[1])) for address in hung))
"""
@pytest.mark.parametrize("patched", ["sockets", "all"])
def test_a_connect_opened_ahead_serves_a_program_under_gevent(server: ServerProcess, patched: str) -> None:
    """Under gevent a socket is served by the hub of the thread that made it. Opened ahead in a
    thread of its own where gevent had patched sockets and not threads, the live server's
    connection failed its first call in the caller's thread with greenlet's "cannot switch to a
    different thread", no client error, and the put with it. It is opened in a greenlet of the
    caller's hub there, and the pass waits on its greenlets' connects as on threads': the live
    server, behind four that never accept, is called once its connect opens, not after the hung
    ones' connects end (their timeouts: 1.6 timeouts), and other greenlets' calls join the connects
    under way rather than connecting again. The hung connects are held back until the puts are
    done: a put that waited on one would outwait the hold."""
    with hung_servers(4, "never accepts") as hung:
        out = subprocess.run([sys.executable, "-c", GEVENT_AHEAD_SCRIPT, patched, str(HELD_CONNECT_S), *hung,
                              f"127.0.0.1:{server.thrift_port}"],
                             cwd=str(ROOT), capture_output=True, text=True, timeout=60 + 4 * HELD_CONNECT_S,
                             env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert out.returncode == 0 and out.stdout.split()[:1] == ["ok"], out.stderr[-3000:]
    outwaited, most = out.stdout.split()[1:]
    assert int(outwaited) == 0 and int(most) == 1, out.stdout  # every hung connect outwaited before


@contextlib.contextmanager
def answering(respond: Callable[[socket.socket], None]) -> Iterator[int]:
    """The port of a peer that is no Kestrel server: each connection's request read, then `respond`."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(8)

        def answer_each() -> None:
            while True:
                try:
                    conn, _ = other.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    with contextlib.suppress(OSError):  # the client gone
                        respond(conn)

        threading.Thread(target=answer_each, daemon=True).start()
        yield other.getsockname()[1]


@pytest.mark.parametrize("answer", [
    b"\x00\x00\x00\x08\xde\xad\xbe\xef\x01\x02\x03\x04",  # a frame that holds no Thrift message
    # a well-formed reply to `put` with no result in it
    struct.pack(">iIi", 4 + 4 + 3 + 4 + 1, 0x80010002, 3) + b"put" + struct.pack(">i", 0) + b"\x00",
    # a frame claiming 2 GB (thriftpy2 allocated it: MemoryError, which no Cluster passed over)
    struct.pack(">i", 2**31 - 1) + b"\x00" * 64,
    # a reply to `put` whose frame ends before it does (thriftpy2 read on into the next frame)
    struct.pack(">iIi", 4 + 4 + 3, 0x80010002, 3) + b"put" + struct.pack(">i", 0) + b"\x08\x00\x00\x00\x00\x00\x01\x00",
], ids=["no message", "no result", "a 2 GB frame", "a frame shorter than its reply"])
def test_a_server_answering_what_is_no_kestrel_reply_is_passed_over(server: ServerProcess, answer: bytes) -> None:
    with answering(lambda conn: conn.sendall(answer)) as port:  # another service on the port, a proxy
        with pytest.raises(ServerUnavailable, match=rf"127.0.0.1:{port}.*put: the answer is not a Kestrel Thrift reply"):
            Server("127.0.0.1", port).put("garbled", [b"x"])
        cluster = Cluster([f"127.0.0.1:{port}", f"127.0.0.1:{server.thrift_port}"])
        try:
            assert cluster.put("garbled", b"x")  # taken by the next server
            assert cluster.get("garbled") == b"x"
        finally:
            cluster.close()


def test_a_get_answered_with_more_items_than_it_asked_for_is_no_kestrel_reply() -> None:
    from thriftpy2.protocol import TBinaryProtocol
    from thriftpy2.thrift import TMessageType
    from thriftpy2.transport import TMemoryBuffer

    from kestrel.contract import kestrel_thrift

    reply = TMemoryBuffer()
    protocol = TBinaryProtocol(reply)
    protocol.write_message_begin("get", TMessageType.REPLY, 0)
    kestrel_thrift.Kestrel.get_result(success=[kestrel_thrift.Item(data=b"%d" % n, id=n) for n in range(5)]
                                      ).write(protocol)
    protocol.write_message_end()
    with answering(lambda conn: conn.sendall(struct.pack(">i", len(reply.getvalue())) + reply.getvalue())) as port:
        with pytest.raises(ServerUnavailable, match=r"get: the answer is not a Kestrel Thrift reply \(5 items, "
                                                    r"where 1 were asked for\)"):
            Server("127.0.0.1", port).get("q", 1)


def test_a_reply_that_comes_a_byte_at_a_time_ends_with_the_call_s_time_out(server: ServerProcess) -> None:
    """The time-out counted each read of the socket alone: a server sending a reply's bytes one by
    one, each before the last read's time-out, held the call for as long as it liked."""
    def trickle(conn: socket.socket) -> None:
        conn.sendall(struct.pack(">i", 1000))
        for _ in range(100):
            time.sleep(0.1)
            conn.sendall(b"\x00")

    with answering(trickle) as port:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match=rf"127.0.0.1:{port}.*put failed: TimeoutError") as lost:
            Server("127.0.0.1", port, timeout_ms=500).put("trickled", [b"x"])
        assert time.monotonic() - started < 3
        assert lost.value.maybe_done


def test_no_server_could_take_it(server: ServerProcess) -> None:
    cluster = Cluster([f"127.0.0.1:{free_port()}", f"127.0.0.1:{server.thrift_port}"])
    with pytest.raises(NoServers) as e:
        cluster.put("bad/name", b"x")  # every server refuses the name; the dead one cannot be reached
    assert sorted(type(err).__name__ for err in e.value.errors) == ["Refused", "ServerUnavailable"]
    assert "no kestrel server could put 1 items on 'bad/name'" in str(e.value)
    one = on(server)
    with pytest.raises(Refused, match="refused"):
        one.put("bad/name", [b"x"])
    one.close()
    with pytest.raises(ServerUnavailable, match="cannot connect"):
        Server("127.0.0.1", free_port()).put("jobs", [b"x"])
    cluster.close()


def test_a_lost_answer_says_the_call_may_have_been_done(server: ServerProcess) -> None:
    with pytest.raises(ServerUnavailable, match="cannot connect") as refused:
        Server("127.0.0.1", free_port()).confirm("jobs", {1})
    assert not refused.value.maybe_done  # it never reached a server
    with socket.socket() as silent:  # accepts connections, never answers: a frozen server
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        frozen = Server("127.0.0.1", silent.getsockname()[1], timeout_ms=200)
        with pytest.raises(ServerUnavailable, match="confirm failed") as lost:
            frozen.confirm("jobs", {1})
        assert lost.value.maybe_done  # sent: the server may have done it before its answer was lost
        frozen.close()
    one = on(server)
    with pytest.raises(Refused):
        one.put("bad/name", [b"x"])  # answered: a refusal is no lost answer
    one.close()


def test_a_plain_get_whose_answer_was_lost_is_not_sent_again(server_factory: Any) -> None:
    """A get without a reliable read that timed out may have taken its items (the server carries it
    out when it wakes): each try again would take more, so the call stops at that server and says so."""
    import signal

    frozen = server_factory()
    assert on(frozen).put("lossy", [b"%d" % i for i in range(5)]) == 5
    assert frozen.proc is not None
    cluster = cluster_of(frozen, timeout_ms=300, retries=3, backoff_ms=1)
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(NoServers) as lost:
            cluster.get_many("lossy", 2)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        cluster.close()
    wait_until(lambda: items_on(frozen, "lossy") < 5, "the woken server to carry out the get it was sent")
    time.sleep(0.5)  # and any other it was sent
    assert items_on(frozen, "lossy") == 3  # one get of 2 was carried out, not one a try
    assert f"may have taken items from 127.0.0.1:{frozen.thrift_port}, lost with its answer" in str(lost.value)


def test_a_put_over_the_servers_frame_size_is_refused_before_it_is_sent(server: ServerProcess) -> None:
    """The servers close a frame over `max_frame_size` unread: every one would look down to the put."""
    with cluster_of(server) as cluster:
        with pytest.raises(ValueError, match=r"1 items make a call of \d+ bytes, over max_frame_size \(16777216\)"):
            cluster.put("big", b"x" * (16 * 1024 * 1024))
        assert cluster.put("big", b"fits")  # and no server was taken for down
        assert not cluster.server(("127.0.0.1", server.thrift_port)).avoids("put")
    with cluster_of(server, max_frame_size=1000) as cluster:
        with pytest.raises(ValueError, match="2 items make a call of"):
            cluster.put_many("big", [b"x" * 500, b"y" * 500])
        assert cluster.put_many("big", [b"x" * 500]) == 1


def test_server_restart_between_calls_is_transparent(server: ServerProcess) -> None:
    one = on(server)
    assert one.put("restart", [b"before"]) == 1
    server.kill()
    server.start()  # the pooled connection is now dead
    assert one.put("restart", [b"after"]) == 1
    assert [i.data for i in one.get("restart", 10)] == [b"before", b"after"]
    one.close()


def test_a_restart_that_closed_every_pooled_connection_is_transparent(server_factory: Any) -> None:
    """The repeat after a dead pooled connection took the next pooled one, as dead: the call failed
    on a server that was up (a one-server Cluster raised NoServers)."""
    srv = server_factory()
    one = on(srv)
    cluster = cluster_of(srv)
    for pool in (one, cluster.server(("127.0.0.1", srv.thrift_port))):
        waits = [threading.Thread(target=pool.get, args=("pooled", 1, 300)) for _ in range(4)]
        for t in waits:
            t.start()
        for t in waits:
            t.join()
        assert len(pool._idle) == 4
    srv.kill()
    srv.start()  # every pooled connection is now dead
    assert one.put("pooled", [b"server"]) == 1
    assert cluster.put("pooled", b"cluster")
    assert cluster.get_many("pooled", 10) == [b"server", b"cluster"]
    one.close()
    cluster.close()


class _ChangingSets:
    """A server source whose sets change as a watched ZooKeeper's do: a new list each time."""

    def __init__(self, *servers: ServerProcess) -> None:
        self.set_to(*servers)

    def set_to(self, *servers: ServerProcess) -> None:
        self.lists = [("127.0.0.1", s.thrift_port) for s in servers]

    def writers(self) -> list[tuple[str, int]]:
        return self.lists

    def readers(self) -> list[tuple[str, int]]:
        return self.lists

    def close(self) -> None:
        pass


def test_a_server_that_left_the_sets_is_let_go(three: list[ServerProcess], server_factory: Any) -> None:
    """A Cluster kept a Server, and its pooled connections, for every address it ever saw: each
    server that left (a rolling restart onto new ports) left a half-closed socket for good."""
    leaving = server_factory()
    sets = _ChangingSets(three[0], leaving)
    cluster = Cluster(sets)

    def connections() -> int:
        return int(memcache_stats(leaving.memcache_port)["curr_connections"])

    for _ in range(4):
        assert cluster.put("sets", b"x")
    held = connections()
    sets.set_to(three[0])
    assert cluster.put("sets", b"y")
    wait_until(lambda: connections() == held - 1, "the pooled connection to be closed")
    assert ("127.0.0.1", leaving.thrift_port) not in cluster._servers
    sets.set_to(three[0], leaving)  # back: a Server afresh
    assert cluster.get_many("sets", 10, timeout=1.0)
    cluster.close()


def test_a_get_over_many_empty_servers_ends_by_its_timeout(three: list[ServerProcess]) -> None:
    """Each server of a round waited min(timeout, poll_ms / servers): three servers waited three
    timeouts (0.2 s took 0.6 s with poll_ms 5,000)."""
    cluster = cluster_of(*three, poll_ms=5_000)
    cluster.get("nothing_here", timeout=0.1)  # connections open, so that the next get is all wait
    started = time.monotonic()
    assert cluster.get("nothing_here", timeout=1.0) is None
    assert 1.0 <= time.monotonic() - started < 2.5  # three timeouts before
    cluster.close()


def test_threads_sharing_a_cluster_each_open_reads_on_a_connection_holding_none(server: ServerProcess) -> None:
    """The server caps a connection's open reads on a queue (max_open_reads, 100); reliable reads
    held by ten threads in turn all went over one pooled connection, and then a reliable read of a
    queue of 400 items found none."""
    cluster = cluster_of(server)
    cluster.put_many("held", [b"%d" % n for n in range(500)])
    holding = threading.Barrier(11)
    release = threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with cluster.reliable_read("held", max_items=10) as items:
                assert len(items) == 10
                holding.wait(STALL_S)
                release.wait(STALL_S)
        except BaseException as e:
            errors.append(e)
            holding.abort()

    threads = []
    for _ in range(10):  # one after another: each get gives its connection back before the next
        threads.append(threading.Thread(target=hold))
        threads[-1].start()
        wait_until(lambda: holding.n_waiting == len(threads) or bool(errors), "the read to be held")
    with cluster.reliable_read("held", max_items=10, timeout=1.0) as items:
        assert len(items) == 10
    holding.wait(STALL_S)
    release.set()
    for t in threads:
        t.join(STALL_S)
    assert not errors
    assert items_on(server, "held") == 390  # every read confirmed
    cluster.close()


def test_get_waits_up_to_the_timeout_and_wakes_on_a_put(three: list[ServerProcess]) -> None:
    cluster = cluster_of(*three, poll_ms=100)
    started = time.monotonic()
    assert cluster.get("empty", timeout=0.3) is None
    assert 0.3 <= time.monotonic() - started < STALL_S
    threading.Timer(0.2, lambda: on(three[2]).put("late", [b"here"])).start()
    started = time.monotonic()
    assert cluster.get("late", timeout=30) == b"here"
    assert time.monotonic() - started < STALL_S  # found while waiting, not at the end of the wait
    cluster.put_many("many", [b"1", b"2", b"3"])
    assert cluster.get_many("many", 10) == [b"1", b"2", b"3"]
    cluster.close()


def test_reliable_read_confirms_on_success_and_aborts_on_error(server: ServerProcess) -> None:
    cluster = cluster_of(server)
    cluster.put_many("reliable", [b"one", b"two", b"three"])
    with pytest.raises(RuntimeError):
        with cluster.reliable_read("reliable", max_items=2) as items:
            assert items == [b"one", b"two"]
            raise RuntimeError("work failed")
    info = on(server).peek("reliable")
    assert (info.items, info.open_transactions, info.head_item) == (3, 0, b"one")
    with cluster.reliable_read("reliable", max_items=2) as items:
        assert items == [b"one", b"two"]
    info = on(server).peek("reliable")
    assert (info.items, info.open_transactions, info.head_item) == (1, 0, b"three")
    with cluster.reliable_read("nothing", timeout=0.1) as items:
        assert items == []
    cluster.close()


def test_reliable_items_confirm_as_the_loop_goes_and_abort_on_leaving(server: ServerProcess) -> None:
    cluster = cluster_of(server)
    cluster.put_many("items", [b"%d" % i for i in range(5)])
    for item in cluster.reliable_items("items"):
        if item == b"2":
            break  # 0 and 1 are confirmed; 2 is in hand and goes back
    assert [i.data for i in on(server).get("items", 10, 0, 0)] == [b"2", b"3", b"4"]
    cluster.put_many("items", [b"a", b"b"])
    with pytest.raises(ValueError):
        for item in cluster.reliable_items("items", batch=2):
            raise ValueError(item)
    assert list(cluster.reliable_items("items", batch=2)) == [b"a", b"b"]
    assert on(server).peek("items").items == 0
    cluster.close()


def test_consume_drains_every_server(three: list[ServerProcess]) -> None:
    cluster = cluster_of(*three)
    cluster.put_many("drain", [b"a%d" % i for i in range(50)])  # all on one server
    for i in range(30):
        cluster.put("drain", b"b%d" % i)  # spread over all three
    seen: list[bytes] = []
    assert cluster.consume("drain", seen.append, batch=7, until_empty=True) == 80
    assert sorted(seen) == sorted([b"a%d" % i for i in range(50)] + [b"b%d" % i for i in range(30)])
    assert [items_on(s, "drain") for s in three] == [0, 0, 0]
    # A failing handler aborts its batch and stops the loop; nothing is lost.
    cluster.put_many("drain", [b"x", b"y"])
    with pytest.raises(KeyError):
        cluster.consume("drain", lambda item: {}[item], until_empty=True)
    assert sum(items_on(s, "drain") for s in three) == 2
    cluster.close()


def test_one_cluster_shared_by_threads(three: list[ServerProcess]) -> None:
    cluster = cluster_of(*three)
    errors: list[BaseException] = []

    def produce(n: int) -> None:
        try:
            for i in range(200):
                cluster.put_many("shared", [b"%d-%d-%d" % (n, i, k) for k in range(3)])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    seen: list[bytes] = []
    lock = threading.Lock()

    def consume() -> None:
        def keep(item: bytes) -> None:
            with lock:
                seen.append(item)
        try:
            while any(t.is_alive() for t in threads):
                cluster.consume("shared", keep, batch=50, until_empty=True)
            cluster.consume("shared", keep, batch=50, until_empty=True)
        except BaseException as e:
            errors.append(e)

    consumers = [threading.Thread(target=consume) for _ in range(3)]
    for t in consumers:
        t.start()
    for t in threads + consumers:
        t.join(60)
    assert not errors
    assert len(seen) == 8 * 200 * 3 and len(set(seen)) == len(seen)
    cluster.close()


def test_cooperative_under_gevent(three: list[ServerProcess]) -> None:
    max_gap, waited = run_gevent_script(",".join(f"127.0.0.1:{s.thrift_port}" for s in three))
    # The get waited half a second or more, three seconds at a time on one server, while the ticker
    # (every 10 ms) was never held up for anything like that.
    assert waited >= 0.5 and max_gap < MAX_TICKER_GAP_S, (max_gap, waited)


def test_items_are_bytes_and_anything_else_is_refused_before_sending(three: list[ServerProcess]) -> None:
    cluster = cluster_of(*three)
    one = on(three[0])
    mistakes: list[tuple[Callable[[], object], str]] = [
        (lambda: cluster.put("typed", "text"), "put on 'typed': the item is str, not bytes.*encode text"),
        (lambda: cluster.put("typed", 7), "the item is int"),
        (lambda: cluster.put_many("typed", "abc"), "items must be a list of bytes, got a single str"),
        (lambda: cluster.put_many("typed", b"abc"), "got a single bytes"),
        (lambda: cluster.put_many("typed", [b"fine", b"also", "text", b"after"]), "item 2 is str"),
        (lambda: cluster.put_many("typed", [b"fine", None]), "item 1 is NoneType"),
        (lambda: cluster.put_many("typed", 42), "items must be a list of bytes, got int"),
        (lambda: cluster.put("typed", b"x", expiration_ms="soon"), "expiration_ms must be an int"),
        (lambda: cluster.put(b"typed", b"x"), "the queue name must be a str"),
        (lambda: one.put("typed", ["text"]), "item 0 is str"),
        (lambda: one.put("typed", "text"), "got a single str"),
        # read ids: a str was taken for one id a character, the rest failed in Thrift's encoder
        (lambda: one.confirm("typed", "123"), "confirm on 'typed': ids must be a set of ints, got str"),
        (lambda: one.confirm("typed", {"1"}), "each id must be an int, got str"),
        (lambda: one.abort("typed", None), "abort on 'typed': ids must be a set of ints, got NoneType"),
        (lambda: one.abort("typed", 5), "got int"),
        (lambda: one.confirm(5, {1}), "the queue name must be a str"),  # type: ignore[arg-type]
        # these raised thriftpy2's TDecodeException, or went to the server to be refused there
        (lambda: one.peek(5), "peek of 5: the queue name must be a str"),  # type: ignore[arg-type]
        (lambda: one.peek(None), "the queue name must be a str"),  # type: ignore[arg-type]
        (lambda: one.set_status("up"), "the status must be a kestrel_thrift.Status value, got str"),  # type: ignore[arg-type]
        (lambda: one.set_status(None), "got NoneType"),  # type: ignore[arg-type]
    ]
    for call, message in mistakes:
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(ValueError, match="id 1180591620717411303424 is outside the contract's 64-bit ids"):
        one.confirm("typed", {2**70})
    with pytest.raises(ValueError, match=r"set_status: 1099511627776 is no status; the statuses are NOT_CONFIGURED "
                                         r"\(0\), QUIESCENT \(1\), READ_ONLY \(2\), UP \(3\)"):
        one.set_status(2**40)
    with pytest.raises(ValueError, match=f"peek_items of 'typed': first must be from 0 to 2147483647, got {2**70}"):
        one.peek_items("typed", first=2**70)
    assert [items_on(s, "typed") for s in three] == [0, 0, 0]  # nothing of a refused batch was sent
    # bytes, bytearray and memoryview are items, stored as their bytes.
    assert cluster.put_many("typed", [b"a", bytearray(b"b"), memoryview(b"xcx")[1:2]]) == 3
    assert cluster.put("typed", bytearray(b"d")) and cluster.put("typed", memoryview(b"e"))
    assert one.put("typed", (bytearray(b"f"),)) == 1
    assert sorted(cluster.get_many("typed", 10) + cluster.get_many("typed", 10) + cluster.get_many("typed", 10)) \
        == [b"a", b"b", b"c", b"d", b"e", b"f"]
    one.close()
    cluster.close()


def test_reads_raise_no_servers_when_no_server_could_be_asked(server: ServerProcess) -> None:
    dead = [f"127.0.0.1:{port}" for port in (free_port(), free_port())]
    down = Cluster(dead)
    reads: list[Callable[[], object]] = [
        lambda: down.get("jobs"),
        lambda: down.get("jobs", timeout=30.0),  # no waiting on servers that are not there
        lambda: down.get_many("jobs", 10),
        lambda: down.reliable_read("jobs").__enter__(),
        lambda: list(down.reliable_items("jobs")),
        lambda: down.consume("jobs", print, until_empty=True),
        lambda: down.consume("jobs", print, stop=threading.Event()),
    ]
    for read in reads:
        started = time.monotonic()
        with pytest.raises(NoServers) as e:
            read()
        assert time.monotonic() - started < STALL_S  # not the 30 s a get may wait
        assert "no kestrel server could get from 'jobs'" in str(e.value)
        assert sorted(err.address for err in e.value.errors if isinstance(err, ServerUnavailable)) == sorted(dead)
    down.close()
    # One server answering is enough to say the queue is empty.
    partly = Cluster([dead[0], f"127.0.0.1:{server.thrift_port}"])
    assert partly.get("nothing-here") is None
    assert partly.get_many("nothing-here", 5) == []
    assert partly.consume("nothing-here", print, until_empty=True) == 0
    # Every server refusing the call (a bad name) is an error at once, not an empty queue.
    with pytest.raises(NoServers, match="refused"):
        partly.get("bad/name")
    partly.close()


def test_closing_is_final_and_both_are_context_managers(server: ServerProcess) -> None:
    with cluster_of(server) as cluster:
        assert cluster.put("closing", b"before")
    assert cluster.closed
    calls: list[Callable[[], object]] = [
        lambda: cluster.put("closing", b"after"),
        lambda: cluster.put_many("closing", [b"after"]),
        lambda: cluster.get("closing"),
        lambda: cluster.get_many("closing", 1),
        lambda: cluster.reliable_read("closing").__enter__(),
        lambda: list(cluster.reliable_items("closing")),
        lambda: cluster.consume("closing", print, until_empty=True),
        lambda: cluster.server(f"127.0.0.1:{server.thrift_port}"),
    ]
    for call in calls:
        with pytest.raises(ClientClosed, match="the client is closed") as e:
            call()
        assert isinstance(e.value, KestrelClientError)
    cluster.close()  # closing again is harmless
    # Closed while a consumer works: the batch in hand is settled (finished items confirmed, the
    # rest back in the queue), then the consumer gets the error.
    busy = cluster_of(server)
    busy.put_many("closing-busy", [b"%d" % i for i in range(10)])

    def closes_at_2(item: bytes) -> None:
        if item == b"2":
            busy.close()

    with pytest.raises(ClientClosed, match="cannot consume 'closing-busy'"):
        busy.consume("closing-busy", closes_at_2, batch=10)
    info = on(server).peek("closing-busy")
    assert (info.items, info.open_transactions, info.head_item) == (7, 0, b"3")
    with on(server) as one:
        assert one.put("closing", [b"one"]) == 1
    with pytest.raises(ClientClosed, match=f"cannot call put on kestrel 127.0.0.1:{server.thrift_port}"):
        one.put("closing", [b"after"])
    with pytest.raises(ClientClosed):
        one.peek("closing")
    assert items_on(server, "closing") == 2


def test_retries_have_a_count_and_a_backoff(server: ServerProcess, retries: Retries) -> None:
    """The pauses asked for, not timed: the client's sleep records them and returns at once."""
    gone = Cluster([f"127.0.0.1:{free_port()}"], retries=3, backoff_ms=100, max_backoff_ms=150)
    with pytest.raises(NoServers, match="cannot connect"):
        gone.put("retried", b"x")
    # Three pauses after the first attempt: 100 ms then 150 ms capped, each shortened by up to half.
    pauses = retries.pauses
    assert retries.puts == 4, pauses
    assert len(pauses) == 3 and 0.05 <= pauses[0] <= 0.1 and all(0.075 <= p <= 0.15 for p in pauses[1:]), pauses
    retries.clear()
    with pytest.raises(NoServers):
        Cluster([f"127.0.0.1:{free_port()}"], retries=0).put("retried", b"x")
    assert retries.puts == 1 and pauses == []
    # A refusal from every server is not retried: the answer would be the same.
    retries.clear()
    refused = Cluster([f"127.0.0.1:{server.thrift_port}"], retries=5, backoff_ms=2000)
    with pytest.raises(NoServers, match="refused"):
        refused.put("bad/name", b"x")
    assert retries.puts == 1 and pauses == []
    for bad in ({"retries": -1}, {"backoff_ms": "1s"}, {"backoff_ms": 500, "max_backoff_ms": 100}):
        with pytest.raises((TypeError, ValueError)):
            Cluster(["k:1"], **bad)
    gone.close()
    refused.close()


def test_a_restarting_server_is_waited_for_within_the_retries(server: ServerProcess) -> None:
    # About 38 s of retries: a server's start on a loaded machine takes seconds, not milliseconds.
    cluster = cluster_of(server, retries=40, backoff_ms=200, max_backoff_ms=1000)
    assert cluster.put("comeback", b"before")
    server.kill()
    restart = threading.Thread(target=server.start)
    restart.start()
    try:
        assert cluster.put("comeback", b"after")  # retried until the server listens again
        assert cluster.get_many("comeback", 10) == [b"before", b"after"]
    finally:
        restart.join()
        cluster.close()


def test_consume_confirms_what_the_handler_finished_and_aborts_the_rest(server: ServerProcess) -> None:
    cluster = cluster_of(server)
    cluster.put_many("acked", [b"%d" % i for i in range(10)])
    seen: list[bytes] = []

    def fails_on_3(item: bytes) -> None:
        seen.append(item)
        if item == b"3":
            raise RuntimeError("cannot handle 3")

    with pytest.raises(RuntimeError, match="cannot handle 3"):
        cluster.consume("acked", fails_on_3, batch=10, until_empty=True)
    assert seen == [b"0", b"1", b"2", b"3"]
    info = on(server).peek("acked")
    # 0, 1 and 2 are done for good; 3 and the items after it are back at the head, in order.
    assert (info.items, info.open_transactions, info.head_item) == (7, 0, b"3")
    # Setting `stop` ends the loop after the item in hand; the rest of the batch goes back.
    stop = threading.Event()
    seen.clear()

    def stops_after_5(item: bytes) -> None:
        seen.append(item)
        if item == b"5":
            stop.set()

    assert cluster.consume("acked", stops_after_5, batch=10, stop=stop) == 3
    assert seen == [b"3", b"4", b"5"]
    assert cluster.get_many("acked", 10) == [b"6", b"7", b"8", b"9"]
    # reliable_items: leaving the loop confirms the finished items of the batch, aborts the rest.
    cluster.put_many("acked", [b"a", b"b", b"c", b"d"])
    for item in cluster.reliable_items("acked", batch=4):
        if item == b"c":
            break
    info = on(server).peek("acked")
    assert (info.items, info.open_transactions, info.head_item) == (2, 0, b"c")
    cluster.close()


def test_a_dead_servers_share_of_puts_spreads_evenly(three: list[ServerProcess]) -> None:
    first, dying, last = three
    cluster = cluster_of(*three)
    dying.kill()
    try:
        for i in range(60):
            assert cluster.put("spread", b"%d" % i)
    finally:
        dying.start()
    counts = [items_on(s, "spread") for s in (first, last)]
    assert sum(counts) == 60 and abs(counts[0] - counts[1]) <= 4, counts
    cluster.close()
    # A server refusing puts by its status (read-only) gives its share evenly to the others too.
    on(first).set_status(kestrel.Status.READ_ONLY)
    try:
        with cluster_of(*three) as fresh:
            for i in range(60):
                assert fresh.put("spread-status", b"%d" % i)
    finally:
        on(first).set_status(kestrel.Status.UP)
    counts = [items_on(s, "spread-status") for s in three]
    assert counts[0] == 0 and abs(counts[1] - counts[2]) <= 4, counts
