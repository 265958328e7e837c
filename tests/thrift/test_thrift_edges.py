"""Thrift at a connection's edges: read ids across restarts, idle and slow clients, wait caps, a
client hanging up during a wait, refusals inside a batch, negative expiry, open reads counted per
connection and queue."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from kestrel.service.session.read_ids import BLOCK, SHIFT, ReadIds
from kestrel.storage.clock import FakeClock
from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.thrift_wire import closed_or_silent, encode_call, framed, read_framed_reply
from tests.support.wire import shared_server  # noqa: F401  (the module's `server`)
from tests.thrift.test_thrift_hostile import client, raw

# The module's `server`: queue settings and an alias its tests need, each queue one test's.
SHARED_SERVER_CONFIG = {"queues": {"small": {"max_item_size": "4"}, "short": {"max_items": 2}, "full": {"max_items": 1}},
                        "aliases": {"both": {"destination_queues": ["roomy", "full"]}}}


def test_read_ids_never_repeat_across_a_restart(server_factory: Any) -> None:
    srv = server_factory()
    with client(srv) as c:
        c.put("jobs", [b"held before the crash", b"second"], 0)
        stale = c.get("jobs", 1, 0, 60_000)[0]
    srv.kill()
    srv.start()
    with client(srv) as c:
        fresh = c.get("jobs", 2, 0, 60_000)
        assert [i.data for i in fresh] == [b"held before the crash", b"second"]
        assert all(i.id > stale.id for i in fresh)
        assert c.confirm("jobs", {stale.id}) == 0  # the stale id closes nothing
        assert c.peek("jobs").open_transactions == 2
        assert c.confirm("jobs", {i.id for i in fresh}) == 2
    assert 0 < stale.id < 2**63


def test_read_ids_start_above_the_stored_floor_when_the_clock_goes_back(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000_000)
    first = ReadIds(str(tmp_path), clock)
    issued = [first.take() for _ in range(3)]
    assert issued[0] == clock.ms << SHIFT and issued == sorted(set(issued))
    clock.ms -= 3_600_000  # an hour back
    again = ReadIds(str(tmp_path), clock)
    assert again.take() >= issued[0] + BLOCK > issued[-1]
    assert (tmp_path / ".kestrel" / "read_ids").read_text().strip().isdigit()


def test_read_ids_reserve_the_next_block_before_handing_it_out(tmp_path: Path) -> None:
    ids = ReadIds(str(tmp_path), FakeClock(1))
    floor = int((tmp_path / ".kestrel" / "read_ids").read_text())
    handed = [ids.take() for _ in range(BLOCK)]
    assert handed[-1] < floor and int((tmp_path / ".kestrel" / "read_ids").read_text()) == floor
    assert ids.take() == floor and int((tmp_path / ".kestrel" / "read_ids").read_text()) == floor + BLOCK


def test_a_run_of_read_ids_is_under_the_floor_written_before_it_is_handed_out(tmp_path: Path) -> None:
    ids = ReadIds(str(tmp_path), FakeClock(1))
    floor = int((tmp_path / ".kestrel" / "read_ids").read_text())
    first = ids.take(BLOCK // 2)
    run = ids.take(2 * BLOCK)  # past the floor and the block after it: two blocks reserved first
    assert run == first + BLOCK // 2
    assert int((tmp_path / ".kestrel" / "read_ids").read_text()) >= run + 2 * BLOCK > floor + BLOCK
    assert ids.take() == run + 2 * BLOCK


def test_idle_clients_are_closed_after_client_timeout(server_factory: Any) -> None:
    srv = server_factory({"client_timeout": "1s"})
    with raw(srv) as idle, client(srv) as busy:
        for _ in range(5):  # a client that keeps talking is not idle
            assert busy.put("q", [b"x"], 0) == 1
            time.sleep(0.3)  # real time: talking every 0.3 s for longer than client_timeout
        assert closed_or_silent(idle, timeout=30)
    assert "idle for longer than client_timeout (1000 ms)" in srv.log()


def test_no_client_timeout_means_idle_forever(server: ServerProcess) -> None:
    with raw(server) as idle:
        assert not closed_or_silent(idle, timeout=0.5)
        idle.sendall(framed(encode_call("binary", "get_version")))
        assert idle.recv(4)


@pytest.mark.parametrize("partial", [b"\x00\x00\x00\x40", b"\x00\x00\x00\x40\x80\x01\x00\x01", b"\x00\x01"])
def test_a_partial_frame_is_closed_after_request_timeout(server_factory: Any, partial: bytes) -> None:
    srv = server_factory({"request_timeout": "300ms"})
    with raw(srv) as slow, client(srv) as other:
        slow.sendall(partial)
        started = time.monotonic()
        assert other.put("q", [b"x"], 0) == 1  # nobody else waits for the slow client
        assert closed_or_silent(slow, timeout=30)
        assert 0.25 < time.monotonic() - started < STALL_S
    assert "request not complete within request_timeout (300 ms)" in srv.log()


def test_a_maximal_frame_header_then_silence_is_closed(server_factory: Any) -> None:
    srv = server_factory({"request_timeout": "300ms", "max_frame_size": "1MB"})
    with raw(srv) as slow:
        slow.sendall(struct.pack("!i", 1024 * 1024))
        assert closed_or_silent(slow, timeout=30)


def test_a_slow_unframed_request_is_closed_after_request_timeout(server_factory: Any) -> None:
    srv = server_factory({"thrift_transport": "buffered", "request_timeout": "300ms"})
    call = encode_call("binary", "put", queue_name="q", items=[b"x" * 100], expiration_msec=0)
    with raw(srv) as slow:
        slow.sendall(call[:30])
        assert closed_or_silent(slow, timeout=30)
    with client(srv, transport="buffered") as c:
        assert c.peek("q").items == 0


def test_get_waits_are_capped_at_max_wait(server_factory: Any) -> None:
    srv = server_factory({"max_wait": "200ms"})
    with client(srv) as c:
        started = time.monotonic()
        assert c.get("empty", 1, 60_000, 0) == []
        assert 0.15 < time.monotonic() - started < STALL_S


@pytest.mark.parametrize("transport", ["framed", "buffered"])
@pytest.mark.parametrize("method", ["get", "get_timed"])
def test_a_client_that_hangs_up_during_a_get_s_wait_takes_no_item(server_factory: Any, transport: str,
                                                                  method: str) -> None:
    """Its wait ends at the hang-up, as a memcache or text client's does: the next item put is kept
    for a live client, not handed to the dead connection (where a get without auto-abort loses it)."""
    srv = server_factory({"thrift_transport": transport})
    queue = f"hang-up-{method}"
    with client(srv, transport=transport) as c:
        assert c.put(queue, [b"first"], 0) == 1  # the queue exists (get_timed creates none)
        assert [item.data for item in c.get(queue, 1, 0, 0)] == [b"first"]
        call = encode_call("binary", method, queue_name=queue, max_items=1, timeout_msec=600_000, auto_abort_msec=0)
        with raw(srv) as gone:
            gone.sendall(framed(call) if transport == "framed" else call)
            wait_until(lambda: c.peek(queue).waiters == 1, "the get to wait")
        wait_until(lambda: c.peek(queue).waiters == 0, "the hung-up get's wait to end", timeout=STALL_S)
        assert c.put(queue, [b"kept"], 0) == 1
        assert [item.data for item in c.get(queue, 1, 0, 0)] == [b"kept"]
    log = srv.log()
    assert "Traceback" not in log and '"level": "error"' not in log


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_calls_sent_during_a_get_s_wait_are_answered_after_it(server_factory: Any, transport: str) -> None:
    srv = server_factory({"thrift_transport": transport})
    calls = [encode_call("binary", "get", seqid=1, queue_name="later", max_items=1, timeout_msec=60_000,
                         auto_abort_msec=0),
             encode_call("binary", "get_version", seqid=2)]
    with client(srv, transport=transport) as c, raw(srv) as waiting:
        waiting.sendall(framed(calls[0]) if transport == "framed" else calls[0])
        wait_until(lambda: c.peek("later").waiters == 1, "the get to wait")
        waiting.sendall(framed(calls[1]) if transport == "framed" else calls[1])
        time.sleep(0.05)  # most likely read during the wait; the answers must not depend on it
        assert c.put("later", [b"arrived"], 0) == 1
        if transport == "framed":
            assert [item.data for item in read_framed_reply(waiting, "binary", "get")] == [b"arrived"]
            assert isinstance(read_framed_reply(waiting, "binary", "get_version"), str)
        else:
            waiting.settimeout(STALL_S)
            received = b""
            while b"get_version" not in received or not received.endswith(b"\x00"):
                received += waiting.recv(65536)
            assert received.index(b"arrived") < received.index(b"get_version")


def test_put_counts_items_accepted_before_an_oversized_one(server: ServerProcess) -> None:
    with client(server) as c:
        assert c.put("small", [b"12345"], 0) == 0
        assert c.put("small", [b"a", b"b", b"12345", b"c"], 0) == 2
        assert [i.data for i in c.get("small", 10, 0, 0)] == [b"a", b"b"]
        assert c.put("short", [b"1", b"2", b"3"], 0) == 2  # queue full inside the batch


def test_put_through_an_alias_counts_only_what_every_destination_took(server: ServerProcess) -> None:
    with client(server) as c:
        assert c.put("both", [b"a"], 0) == 1
        assert c.put("both", [b"b"], 0) == 0  # "full" refused it
        assert c.put("both", [b"c", b"d"], 0) == 0
        assert c.peek("full").items == 1
        assert c.peek("roomy").items == 3  # as Kestrel: a, b and c went to every destination; d was not tried


def test_a_negative_expiration_means_already_expired(server: ServerProcess) -> None:
    with client(server) as c:
        assert c.put("gone", [b"x", b"y"], -1) == 2
        assert c.get("gone", 10, 0, 0) == []
        assert c.put("gone", [b"kept"], 0) == 1
        assert [i.data for i in c.get("gone", 10, 0, 0)] == [b"kept"]


def test_max_open_reads_is_counted_per_connection_and_queue(server_factory: Any) -> None:
    srv = server_factory({"max_open_reads": 2})
    with client(srv) as c:
        c.put("a", [b"1", b"2", b"3"], 0)
        c.put("b", [b"1", b"2", b"3"], 0)
        held = c.get("a", 5, 0, 60_000)
        assert len(held) == 2 and c.get("a", 1, 0, 60_000) == []
        assert len(c.get("b", 5, 0, 60_000)) == 2  # another queue is not starved by "a"
        assert c.confirm("a", {held[0].id}) == 1
        assert len(c.get("a", 5, 0, 60_000)) == 1


def test_a_confirm_from_another_connection_frees_the_readers_slot(server_factory: Any) -> None:
    srv = server_factory({"max_open_reads": 1})
    with client(srv) as reader, client(srv) as closer:
        reader.put("q", [b"1", b"2"], 0)
        first = reader.get("q", 1, 0, 60_000)[0]
        assert reader.get("q", 1, 0, 60_000) == []
        assert closer.confirm("q", {first.id}) == 1
        assert len(reader.get("q", 1, 0, 60_000)) == 1


def test_pipelined_framed_requests_are_answered_in_order(server: ServerProcess) -> None:
    calls = b"".join(framed(encode_call("binary", "put", seqid=n, queue_name="p", items=[b"%d" % n],
                                        expiration_msec=0)) for n in range(1, 6))
    with raw(server) as s:
        s.sendall(calls)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    seqids = []
    while data:
        (size,) = struct.unpack("!i", data[:4])
        seqids.append(struct.unpack("!i", data[4 + 4 + 4 + 3:4 + 4 + 4 + 3 + 4])[0])
        data = data[4 + size:]
    assert seqids == [1, 2, 3, 4, 5]


def test_frames_arriving_in_pieces_are_answered_as_whole_ones(server: ServerProcess) -> None:
    """A frame is read in place only once it is whole: a put sent as its header, part of its payload,
    then the rest with the start of the next call, gets the same answers as if sent at once."""
    put = framed(encode_call("binary", "put", seqid=1, queue_name="pieces", items=[b"x" * 300], expiration_msec=0))
    get = framed(encode_call("binary", "get", seqid=2, queue_name="pieces", max_items=1, timeout_msec=0,
                             auto_abort_msec=0))
    with raw(server) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in (put[:4], put[4:100], put[100:] + get[:7], get[7:]):
            s.sendall(piece)
            time.sleep(0.02)  # most likely a receive of its own; the answers must not depend on it
        assert read_framed_reply(s, "binary", "put") == 1
        assert [item.data for item in read_framed_reply(s, "binary", "get")] == [b"x" * 300]


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_a_pipelined_burst_is_answered_frame_by_frame_in_order(server_state: Any, protocol: str) -> None:
    """Every reply goes out as one frame, its size first, in the order of the calls: a large item's
    (its bytes kept where they are until the frame is made), small ones, an error's, and a call
    whose frame arrives in two parts."""
    import gevent
    import gevent.socket

    from kestrel.service.thrift.handler import ThriftConnection

    server_state.config.thrift_protocol = protocol
    big = bytes(range(256)) * 256  # 64 KiB
    calls = [("put", {"queue_name": "q", "items": [big, b"small"], "expiration_msec": 0}),
             ("get", {"queue_name": "q", "max_items": 1, "timeout_msec": 0, "auto_abort_msec": 0}),
             ("put", {"items": [b"x"], "expiration_msec": 0}),  # no queue: an error's reply
             ("get", {"queue_name": "q", "max_items": 5, "timeout_msec": 0, "auto_abort_msec": 0}),
             ("get_version", {})]
    burst = b"".join(framed(encode_call(protocol, name, **args)) for name, args in calls)
    ours, theirs = gevent.socket.socketpair()
    served = gevent.spawn(ThriftConnection(server_state, ours, "test").run)
    try:
        theirs.sendall(burst[:-7])  # the last call's frame arrives in two parts
        gevent.sleep(0.01)
        theirs.sendall(burst[-7:])
        replies = [read_framed_reply(theirs, protocol, name) for name, _ in calls]
        theirs.shutdown(socket.SHUT_WR)
        served.get(timeout=STALL_S)
    finally:
        theirs.close()
    assert replies[0] == 2
    assert [item.data for item in replies[1]] == [big]
    assert "queue_name is missing" in replies[2].message
    assert [item.data for item in replies[3]] == [b"small"]
    assert isinstance(replies[4], str)
