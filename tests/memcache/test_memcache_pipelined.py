"""Pipelined memcache bursts against the same commands one at a time: byte-identical replies, the
same queues after, the same counters.

The server answers a run of plain `set`s to one queue, or of plain `get`s, in one go
(src/kestrel/service/memcache/runs.py); every other command goes through `commands.parse_line` one by one. Each
burst is sent to one server at once (or in pieces) and to a second server, with the same settings,
one command per send and with the command names in capitals (`SET`, `GET`: the same commands to
`parse_line`, which no run takes), so the second server answers every command one by one, as the
server did before runs existed.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pymemcache.client.base import Client as MemcacheClient

from kestrel import SERVER_VERSION
from tests.conftest import ServerProcess, wait_until
from tests.support.lines import DEADLINE_S, exchange

SENTINEL = b"version\r\n"
VERSION_LINE = b"VERSION %s\r\n" % SERVER_VERSION.encode()
MAX_FRAME = 64
MAX_LINE = 100

CONFIG = {
    "max_frame_size": MAX_FRAME,
    "max_line_length": MAX_LINE,
    "queues": {
        "full": {"max_items": 3},
        "discard": {"max_items": 3, "discard_old_when_full": True},
        "small": {"max_item_size": 8},
        "fan+a": {"max_items": 2},
    },
    "aliases": {"both": {"destination_queues": ["full", "plain"]}},
}
QUEUES = ["plain", "full", "discard", "small", "both", "fan", "fan+a"]


@pytest.fixture(scope="module", params=["kestrel2", "kestrel3"])
def servers(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(the server under test, the reference fed one command at a time), with the same settings and
    each journal format."""
    config = {**CONFIG, "default_queue": {"journal_format": request.param}}
    batched = ServerProcess(tmp_path_factory.mktemp("batched"), config).start()
    reference = ServerProcess(tmp_path_factory.mktemp("reference"), config).start()
    yield batched, reference
    batched.stop()
    reference.stop()


def set_command(queue: str, data: bytes, exptime: int = 0, noreply: bool = False, size: int | None = None) -> bytes:
    tail = b" noreply" if noreply else b""
    size = len(data) if size is None else size
    return b"set %s 0 %d %d%s\r\n%s\r\n" % (queue.encode(), exptime, size, tail, data)


def get_command(key: str) -> bytes:
    return b"get %s\r\n" % key.encode()


def one_by_one(command: bytes) -> bytes:
    """The same command in capitals, which no run takes: `parse_line` reads `SET` and `GET` as it
    reads `set` and `get`."""
    for name in (b"set ", b"get "):
        if command.startswith(name):
            return name.upper() + command[len(name):]
    return command


def read_replies(sock: socket.socket) -> bytes:
    """Every reply up to the sentinel's, or up to the server closing the connection."""
    data = b""
    deadline = time.monotonic() + DEADLINE_S
    while not data.endswith(VERSION_LINE) and time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def send_burst(port: int, commands: list[bytes], cuts: tuple[int, ...] = ()) -> bytes:
    """All the commands at once (in pieces cut at `cuts`, sent a moment apart), then the sentinel."""
    burst = b"".join(commands) + SENTINEL
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = 0
        for cut in sorted(cuts):
            sock.sendall(burst[start:cut])
            time.sleep(0.002)
            start = cut
        try:
            sock.sendall(burst[start:])
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server part way (a line too long): its replies are still to read
        return read_replies(sock)


def send_one_by_one(port: int, commands: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for command in [*map(one_by_one, commands), SENTINEL]:
                sock.sendall(command)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_replies(sock)


def stats(port: int) -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        text = exchange(sock, b"stats\r\n", b"END\r\n").decode()
    return {parts[1]: parts[2] for line in text.splitlines() if len(parts := line.split(" ", 2)) == 3}


def drain(srv: ServerProcess) -> dict[str, list[bytes]]:
    """Once the server has closed the burst's connection (its open reads back in their queues),
    every queue's items, taken one by one: the queues are empty for the next burst."""
    wait_until(lambda: stats(srv.memcache_port)["curr_connections"] == "1", "the burst's connection closed")
    found: dict[str, list[bytes]] = {}
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=DEADLINE_S) as sock:
        for queue in QUEUES:
            items = found[queue] = []
            while (reply := exchange(sock, b"GET %s\r\n" % queue.encode(), b"END\r\n")) != b"END\r\n":
                items.append(reply)
    return found


def compare(servers: tuple[ServerProcess, ServerProcess], commands: list[bytes], cuts: tuple[int, ...] = ()) -> bytes:
    """The burst's replies, once checked equal to the one-by-one server's, byte for byte, and the
    queues after it equal too."""
    batched, reference = servers
    got = send_burst(batched.memcache_port, commands, cuts)
    want = send_one_by_one(reference.memcache_port, commands)
    assert got == want
    assert drain(batched) == drain(reference)
    return got


def test_a_queue_filling_part_way_through_a_run(servers: tuple[ServerProcess, ServerProcess]) -> None:
    sets = [set_command("full", b"item %d" % n) for n in range(5)]
    assert compare(servers, sets) == b"STORED\r\n" * 3 + b"NOT_STORED\r\n" * 2 + VERSION_LINE
    # Discarding old items when full, every set is stored and the queue keeps the newest three.
    commands = [set_command("discard", b"item %d" % n) for n in range(5)] + [get_command("discard")] * 4
    assert compare(servers, commands) == b"STORED\r\n" * 5 + b"".join(
        b"VALUE discard 0 6\r\nitem %d\r\nEND\r\n" % n for n in (2, 3, 4)) + b"END\r\n" + VERSION_LINE


def test_noreply_sets_mixed_in_answer_only_the_others(servers: tuple[ServerProcess, ServerProcess]) -> None:
    sets = [set_command("full", b"%d" % n, noreply=n % 2 == 1) for n in range(6)]
    # stored: 0 1 2 (1 silent); refused: 3 4 5 (3 and 5 silent)
    assert compare(servers, sets) == b"STORED\r\nSTORED\r\nNOT_STORED\r\n" + VERSION_LINE
    assert compare(servers, [set_command("plain", b"x", noreply=True)] * 3) == VERSION_LINE


def test_sets_with_different_expiries_and_an_expired_one(servers: tuple[ServerProcess, ServerProcess]) -> None:
    commands = [set_command("plain", b"a"), set_command("plain", b"b", exptime=3600),
                set_command("plain", b"c", exptime=3600), set_command("plain", b"gone", exptime=-1),
                set_command("plain", b"d", exptime=2_000_000_000), set_command("plain", b"e")]
    reply = compare(servers, commands + [get_command("plain")] * 6)
    assert reply == b"STORED\r\n" * 6 + b"".join(
        b"VALUE plain 0 1\r\n%s\r\nEND\r\n" % d for d in (b"a", b"b", b"c", b"d", b"e")) + b"END\r\n" + VERSION_LINE


def test_a_burst_split_at_every_byte_boundary(servers: tuple[ServerProcess, ServerProcess]) -> None:
    commands = [set_command("full", b"one"), set_command("full", b"two", noreply=True), set_command("full", b"3"),
                set_command("full", b"four"), get_command("full"), get_command("full"),
                get_command("full"), get_command("full")]
    want = send_one_by_one(servers[1].memcache_port, commands)
    drain(servers[1])
    assert want == (b"STORED\r\nSTORED\r\nNOT_STORED\r\nVALUE full 0 3\r\none\r\nEND\r\n"
                    b"VALUE full 0 3\r\ntwo\r\nEND\r\nVALUE full 0 1\r\n3\r\nEND\r\nEND\r\n" + VERSION_LINE)
    size = len(b"".join(commands))
    for cut in range(1, size):
        assert send_burst(servers[0].memcache_port, commands, (cut,)) == want, cut
    assert drain(servers[0]) == {queue: [] for queue in QUEUES}


ODD_SETS = [
    b"set plain 4294967295 0 3\r\nmax\r\n",  # the largest flags memcache has
    b"set plain 00 -0 02\r\nz0\r\n",  # zeros written long
    b"set plain 0 -2147483648 1\r\ne\r\n",  # the earliest expiry: already expired
    b"set plain 0 4294967295 1\r\nl\r\n",  # the latest: in 2106
    b"set plain 0 999999 1\r\nr\r\n",  # relative, in 11 days
    b"set plain 0 1000000 1\r\na\r\n",  # absolute, in 1970: expired
    b"set plain 0 0 0\r\n\r\n",  # an empty item
    b"set plain 4294967296 0 1\r\nF\r\n",  # flags past 32 bits: refused, its data skipped
    b"set plain 0 4294967296 1\r\nE\r\n",  # exptime past 32 bits: refused likewise
    b"set plain +1 +0 +1\r\nP\r\n",  # signs, as Kestrel's parseInt reads them
    b"set plain ++1 0 1\r\nQ\r\n",  # two: refused, its data skipped
    b"set plain 0 0 2\r\nshort\r\n",  # fewer bytes announced than sent: a bad data chunk
]


def test_sets_with_odd_flags_expiries_and_byte_counts_split_at_every_byte(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    """Each answered, whole or in two pieces cut anywhere, as a set alone is answered: STORED, or an
    error naming the field, its data never run as a command; the items stored as sent."""
    commands = [*ODD_SETS, *[get_command("plain")] * 6]
    want = compare(servers, commands)
    assert want.count(b"STORED\r\n") == 8 and want.count(b"CLIENT_ERROR") == 4
    for value in (b"max", b"z0", b"l", b"r", b"", b"P"):
        assert b"VALUE plain 0 %d\r\n%s\r\n" % (len(value), value) in want
    size = len(b"".join(commands))
    for cut in range(1, size):
        assert send_burst(servers[0].memcache_port, commands, (cut,)) == want, cut
    assert drain(servers[0]) == {queue: [] for queue in QUEUES}


def test_a_run_of_gets_emptying_the_queue(servers: tuple[ServerProcess, ServerProcess]) -> None:
    commands = [set_command("plain", b"x%d" % n) for n in range(3)] + [get_command("plain")] * 5
    assert compare(servers, commands).endswith(b"VALUE plain 0 2\r\nx2\r\nEND\r\nEND\r\nEND\r\n" + VERSION_LINE)
    before = stats(servers[0].memcache_port)
    mc = MemcacheClient(("127.0.0.1", servers[0].memcache_port), timeout=DEADLINE_S)
    try:
        for n in range(3):
            assert mc.set("plain", b"p%d" % n, noreply=True)  # sent without waiting: one run
        assert [mc.get("plain") for _ in range(4)] == [b"p0", b"p1", b"p2", None]
    finally:
        mc.close()
    after = stats(servers[0].memcache_port)
    counted = {name: int(after[name]) - int(before[name]) for name in ("cmd_set", "cmd_get", "get_hits", "get_misses")}
    assert counted == {"cmd_set": 3, "cmd_get": 4, "get_hits": 3, "get_misses": 1}


def test_a_plain_get_beside_an_open_read_answers_error_and_closes(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    commands = [set_command("plain", b"a"), set_command("plain", b"b"), get_command("plain/open"),
                get_command("plain"), get_command("plain"), get_command("plain")]
    assert compare(servers, commands) == b"STORED\r\nSTORED\r\nVALUE plain/open 0 1\r\na\r\nEND\r\nERROR\r\n"
    # The open read was aborted with the connection: `a` went back, the drain found both.


def test_a_run_of_gets_ended_by_an_open_read_counts_the_gets_answered(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    """The get that answers ERROR beside an open read is counted in the latency histogram, as it
    is alone; the gets after it are never read."""
    before = [counters(srv) for srv in servers]
    commands = [set_command("full", b""), get_command("full/open")] + [get_command("full")] * 4
    assert compare(servers, commands).endswith(b"ERROR\r\n")  # and the connection closed
    batched, reference = ({name: count - before[n].get(name, 0) for name, count in counters(srv).items()}
                          for n, srv in enumerate(servers))
    assert batched == reference


def test_bad_lines_and_an_item_over_max_frame_size_in_the_middle_of_runs(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    big = b"z" * (MAX_FRAME + 1)
    commands = [set_command("plain", b"1"), b"delete\r\n", set_command("plain", b"2"), set_command("plain", big),
                set_command("plain", b"3"), set_command("plain", b"4", size=2),  # bad data chunk
                set_command("plain", b"5"), get_command("plain"), b"get plain/nonsense\r\n",
                get_command("plain"), b"set plain 0 0 abc\r\n", get_command("plain")]
    assert compare(servers, commands) == (
        b"STORED\r\nCLIENT_ERROR usage: delete <queue> [noreply]\r\nSTORED\r\nSERVER_ERROR object too large for cache\r\n"
        b"STORED\r\nCLIENT_ERROR bad data chunk\r\nSTORED\r\nVALUE plain 0 1\r\n1\r\nEND\r\n"
        b"CLIENT_ERROR unknown get option 'nonsense'\r\nVALUE plain 0 1\r\n2\r\nEND\r\n"
        b"CLIENT_ERROR bad byte count 'abc': expected 0..2147483647 (closing: the item's length is unknown)\r\n")


def test_a_line_too_long_in_a_run_closes_as_before(servers: tuple[ServerProcess, ServerProcess]) -> None:
    commands = [get_command("plain"), get_command("plain"), get_command("p" * MAX_LINE), get_command("plain")]
    assert compare(servers, commands) == b"END\r\nEND\r\nCLIENT_ERROR line too long\r\n"


def test_aliases_fanouts_and_items_over_max_item_size_go_one_by_one_with_the_same_replies(
        servers: tuple[ServerProcess, ServerProcess]) -> None:
    # An item over `small`'s max_item_size is refused and the next one stored: not a prefix.
    reply = compare(servers, [set_command("small", b"tiny"), set_command("small", b"far too big"),
                              set_command("small", b"ok")])
    assert reply == b"STORED\r\nNOT_STORED\r\nSTORED\r\n" + VERSION_LINE
    # Through the alias an item counts only if `full` and `plain` both take it.
    reply = compare(servers, [set_command("both", b"%d" % n) for n in range(5)])
    assert reply == b"STORED\r\n" * 3 + b"NOT_STORED\r\n" * 2 + VERSION_LINE
    # A fanout child (max_items 2) gets every item offered once; the parent takes all.
    commands = [get_command("fan+a")] + [set_command("fan", b"%d" % n) for n in range(4)] + [get_command("fan+a")] * 3
    assert compare(servers, commands) == (b"END\r\n" + b"STORED\r\n" * 4 + b"VALUE fan+a 0 1\r\n0\r\nEND\r\n"
                                          b"VALUE fan+a 0 1\r\n1\r\nEND\r\nEND\r\n" + VERSION_LINE)


_commands = st.one_of(
    st.builds(set_command, st.sampled_from(QUEUES), st.sampled_from([b"", b"a", b"12345678", b"123456789", b"x" * 20,
                                                                     b"y" * MAX_FRAME, b"w" * (MAX_FRAME + 1)]),
              st.sampled_from([0, 0, 0, 3600, -1, 2_000_000_000]), st.booleans()),
    st.builds(get_command, st.sampled_from(QUEUES)),
    st.builds(get_command, st.sampled_from(QUEUES)),
    st.builds(lambda q, o: get_command(q + o), st.sampled_from(QUEUES),
              st.sampled_from(["/open", "/close", "/abort", "/peek", "/close/open", "/t=1"])),
    st.sampled_from([b"bogus\r\n", b"set plain 0 0 2\r\nabcd\r\n", b"flush full\r\n", b"confirm plain 1\r\n",
                     b"gets plain\r\n", b"delete discard\r\n", b"get " + b"q" * MAX_LINE + b"\r\n",
                     b"add plain 0 0 1\r\nx\r\n", b"get\r\n"]),
)


def test_generated_bursts_answer_as_one_by_one(servers: tuple[ServerProcess, ServerProcess]) -> None:
    before = [counters(srv) for srv in servers]

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.tuples(_commands, st.integers(1, 4)), max_size=10), st.lists(st.integers(1, 2000), max_size=2))
    def burst(repeated: list[tuple[bytes, int]], cuts: list[int]) -> None:
        commands = [command for command, times in repeated for _ in range(times)]  # runs come often
        size = len(b"".join(commands))
        compare(servers, commands, tuple(cut for cut in cuts if cut < size))

    burst()
    # Every command counted alike: the server's counters, and the latency histogram's requests.
    batched, reference = ({name: count - before[n].get(name, 0) for name, count in counters(srv).items()}
                          for n, srv in enumerate(servers))
    assert batched == reference
    assert batched["cmd_set"] > 0 and batched["request get"] > 0


def counters(srv: ServerProcess) -> dict[str, float]:
    """The counters of memcache's `stats`, and the memcache requests in the latency histogram by
    command (`request <command>`)."""
    found: dict[str, float] = {name: float(value) for name, value in stats(srv.memcache_port).items()
                               if name in ("cmd_get", "cmd_set", "cmd_peek", "get_hits", "get_misses")}
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/metrics", timeout=DEADLINE_S).read().decode()
    for line in text.splitlines():
        if line.startswith("kestrel_request_duration_seconds_count{") and 'protocol="memcache"' in line:
            command = line.split('command="', 1)[1].split('"', 1)[0]
            if command != "stats":  # how often `drain` asked for them varies
                found[f"request {command}"] = float(line.rsplit(" ", 1)[1])
    return found
