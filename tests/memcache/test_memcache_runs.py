"""The compiled scanner of pipelined runs (src/kestrel/service/memcache/_scan.c) against
`commands.parse_line`, the memcache grammar's one Python reading: for every line a run takes, at
every split of intact and damaged buffers, the command parse_line reads from it; and a run stops
where another command begins. A connection names a run's queue once for runs of one key in a row.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.service.memcache import runs
from kestrel.service.memcache.commands import Command, parse_line

_scan = pytest.importorskip("kestrel.service.memcache._scan", reason="built without a C compiler")

MAX_LINE = 64
MAX_ITEM = 32


def both_scans(buf: bytes, pos: int, end: int, max_line: int = MAX_LINE, max_item: int = MAX_ITEM,
               limit: int = runs.RUN_LIMIT) -> tuple[object, object]:
    """The scanner's runs of sets and of gets at `pos` (the same in `bytes` and in a receive buffer)."""
    sets = _scan.scan_sets(buf, pos, end, max_line, max_item, limit)
    assert _scan.scan_sets(bytearray(buf), pos, end, max_line, max_item, limit) == sets
    gets = _scan.scan_gets(buf, pos, end, max_line, limit)
    assert _scan.scan_gets(bytearray(buf), pos, end, max_line, limit) == gets
    return sets, gets


def check_against_parse_line(buf: bytes, pos: int, sets: object, gets: object) -> None:
    """Each command of a run is what parse_line reads from its line: same key, expiry, size, noreply."""
    if sets is not None:
        key, exptime, datas, answered, end = sets  # type: ignore[misc]
        for data, flag in zip(datas, answered, strict=True):
            nl = buf.index(b"\n", pos)
            command = parse_line(buf[pos:nl - 1])
            assert (command.name, command.key, command.expiry, command.size, command.noreply) == (
                "set", key.decode(), exptime, len(data), not flag)
            assert buf[nl + 1:nl + 1 + len(data)] == data and buf[nl + 1 + len(data):nl + 3 + len(data)] == b"\r\n"
            pos = nl + 3 + len(data)
        assert pos == end
    if gets is not None:
        key, count, end = gets  # type: ignore[misc]
        for _ in range(count):
            nl = buf.index(b"\n", pos)
            command = parse_line(buf[pos:nl - 1])
            assert command == Command("get", key=key.decode(), get=command.get)
            assert command.get is not None and command.get.queue == key.decode()
            assert not (command.get.timeout_ms or command.get.open or command.get.close or command.get.abort
                        or command.get.peek)
            pos = nl + 1
        assert pos == end


def test_a_run_of_sets_stops_at_another_key_expiry_or_shape() -> None:
    buf = (b"set q 0 0 5\r\nhello\r\nset q 7 0 3 noreply\r\nabc\r\nset q 0 0 0\r\n\r\n"
           b"set q 0 9 1\r\nx\r\nget q\r\n")
    sets, gets = both_scans(buf, 0, len(buf))
    assert sets == (b"q", 0, [b"hello", b"abc", b""], b"\x01\x00\x01", buf.index(b"set q 0 9"))
    assert gets is None
    check_against_parse_line(buf, 0, sets, gets)
    assert both_scans(buf, buf.index(b"set q 0 9"), len(buf))[0] == (b"q", 9, [b"x"], b"\x01", buf.index(b"get"))


def test_a_run_of_gets_stops_at_another_key_or_options() -> None:
    buf = b"get q\r\nget q\r\nget q\r\nget q/open\r\nget r\r\n"
    sets, gets = both_scans(buf, 0, len(buf))
    assert sets is None and gets == (b"q", 3, buf.index(b"get q/open"))
    check_against_parse_line(buf, 0, sets, gets)
    assert both_scans(buf, buf.index(b"get q/open"), len(buf)) == (None, None)
    assert both_scans(buf, buf.index(b"get r"), len(buf))[1] == (b"r", 1, len(buf))


@pytest.mark.parametrize("line", [
    b"set q 0 0 5\n", b"SET q 0 0 5\r\n", b"set  q 0 0 5\r\n", b"set q 0 0 5 \r\n", b"set q -0 0 5\r\n",
    b"set q 0 -1 5\r\n", b"set q 0 0 5 noreplyx\r\n", b"set q 0 0 00000000005\r\n", b"set q 4294967296 0 5\r\n",
    b"set q 0 4294967296 5\r\n", b"set q 0 0 33\r\n", b"set q\xc3\xa9 0 0 5\r\n", b"set q 0 0 5 noreply extra\r\n",
    b"set q 0 0 5\r\r\n", b"gets q\r\n", b"get q\n", b"get q/t=10\r\n", b"get  q\r\n", b"get q r\r\n", b"get \r\n",
    b"GET q\r\n",
])
def test_other_shapes_go_to_the_general_parser(line: bytes) -> None:
    buf = line + b"hello\r\n"
    assert both_scans(buf, 0, len(buf)) == (None, None)


def test_bounds_come_before_anything_is_read() -> None:
    line = b"set " + b"k" * 50 + b" 0 0 5\r\nhello\r\n"
    nl = line.index(b"\n")
    assert both_scans(line, 0, len(line), max_line=nl)[0] is not None
    assert both_scans(line, 0, len(line), max_line=nl - 1) == (None, None)  # the general path refuses it
    item = b"set q 0 0 32\r\n" + b"x" * 32 + b"\r\n"
    assert both_scans(item, 0, len(item), max_item=32)[0] is not None
    assert both_scans(item, 0, len(item), max_item=31) == (None, None)  # "object too large", one by one
    gets = b"get q\r\n" * 5
    assert both_scans(gets, 0, len(gets), limit=3)[1] == (b"q", 3, 21)
    assert both_scans(gets, 0, len(gets), limit=0) == (None, None)
    with pytest.raises(ValueError):
        _scan.scan_gets(gets, 0, len(gets) + 1, MAX_LINE, 5)


def test_a_burst_cut_anywhere_is_a_shorter_run_never_a_partial_command() -> None:
    burst = b"set q 0 0 5\r\nhello\r\nset q 0 0 3 noreply\r\nabc\r\nget q\r\nget q\r\n"
    for end in range(len(burst) + 1):
        for pos in (0, burst.index(b"set q 0 0 3"), burst.index(b"get")):
            if pos <= end:
                sets, gets = both_scans(burst, pos, end)
                check_against_parse_line(burst[:end], pos, sets, gets)


_pieces = st.sampled_from([
    b"set q 0 0 5\r\nhello\r\n", b"set q 0 0 3 noreply\r\nabc\r\n", b"set q 0 60 1\r\nx\r\n", b"set r 0 0 0\r\n\r\n",
    b"set q 0 0 40\r\n" + b"y" * 40 + b"\r\n", b"set q 0 0 2\r\nabc\r\n", b"set q 1 2", b"get q\r\n", b"get r\r\n",
    b"get q/open\r\n", b"get q", b"\r\n", b"\n", b" ", b"bogus\r\n", b"set q 0 0 99999999999\r\n",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=12), st.data())
def test_generated_buffers_scan_as_parse_line_reads_them(pieces: list[bytes], data: st.DataObject) -> None:
    buf = b"".join(pieces)
    end = data.draw(st.integers(0, len(buf)), label="end")
    pos = data.draw(st.sampled_from([0, *[sum(map(len, pieces[:i])) for i in range(len(pieces))]]), label="pos")
    pos = min(pos, end)
    sets, gets = both_scans(buf, pos, end)
    check_against_parse_line(buf[:end], pos, sets, gets)


def test_values_lays_out_what_single_gets_answer() -> None:
    datas = [b"", b"x", b"y" * 1000, bytes(range(256))]
    for cut in range(len(datas) + 1):
        for misses in (0, 1, 3):
            laid = _scan.values(b"q/x", datas[:cut], misses)
            assert laid == runs.values_python(b"q/x", datas[:cut], misses)
            assert laid == b"".join(b"VALUE q/x 0 %d\r\n%s\r\nEND\r\n" % (len(d), d) for d in datas[:cut]) + (
                b"END\r\n" * misses)
    with pytest.raises(TypeError):
        _scan.values(b"q", ["text"], 0)



def test_runs_of_one_key_share_its_queue_name_and_other_keys_name_their_own(server_state: Any) -> None:
    """A connection makes the queue name of a run's key once for runs of the same key in a row
    (`queue_named`): the same str, whose hash the queue's lookup has computed; a run of another key
    names its own queue, and its items go there."""
    from kestrel.service.memcache.handler import MemcacheConnection

    ours, theirs = socket.socketpair()
    connection = MemcacheConnection(server_state, ours, "test")
    first = connection.queue_named(b"jobs")
    assert first == "jobs" and connection.queue_named(b"jobs") is first
    assert connection.queue_named(b"jobs2") == "jobs2" and connection.queue_named(b"jobs") == "jobs"
    burst = b"set a 0 0 1\r\nx\r\nset b 0 0 1\r\ny\r\nset a 0 0 1\r\nz\r\nget b\r\nget a\r\nget a\r\n"
    assert connection.process(bytearray(burst)) == len(burst)
    connection.send()
    replies = b""
    while not replies.endswith(b"z\r\nEND\r\n"):
        replies += theirs.recv(4096)
    assert replies == (b"STORED\r\n" * 3 + b"VALUE b 0 1\r\ny\r\nEND\r\nVALUE a 0 1\r\nx\r\nEND\r\n"
                       b"VALUE a 0 1\r\nz\r\nEND\r\n")
    ours.close()
    theirs.close()
