"""The memcache port against hostile input, slow and vanishing clients, and Kestrel's exact replies."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.wire import (
    close_sockets,  # noqa: F401  (autouse: closes the sockets before the servers stop)
    closed_by_server,
    conn,
    exchange,
    memcache_stats,
    shared_server,  # noqa: F401  (the module's `server`)
)

# The module's `server`: queue settings and an alias its tests need, each queue one test's.
SHARED_SERVER_CONFIG = {"queues": {"full": {"max_items": 1}, "aliased_full": {"max_items": 1}},
                        "aliases": {"both": {"destination_queues": ["aliased_full"]}}}


def set_item(port: int, queue: str, data: bytes) -> None:
    with conn(port) as s:
        assert exchange(s, b"set %s 0 0 %d\r\n%s\r\n" % (queue.encode(), len(data), data)) == b"STORED\r\n"


def get_item(port: int, queue: str) -> bytes:
    with conn(port) as s:
        return exchange(s, f"get {queue}\r\n".encode(), b"END\r\n")


# ---------------------------------------------------------------------------------------------
# Item data never runs as commands


def test_set_with_an_unreadable_length_closes_and_never_runs_the_data(server: ServerProcess) -> None:
    set_item(server.memcache_port, "victim", b"precious")
    s = conn(server.memcache_port)
    s.sendall(b"set victim 0 0 abc\r\nshutdown\r\nflush victim\r\n")
    reply = s.recv(4096)
    assert reply.startswith(b"CLIENT_ERROR bad byte count 'abc'")
    assert closed_by_server(s)
    assert server.proc is not None and server.proc.poll() is None
    assert get_item(server.memcache_port, "victim") == b"VALUE victim 0 8\r\nprecious\r\nEND\r\n"


def test_a_set_with_an_argument_too_many_closes_and_never_runs_the_data(server: ServerProcess) -> None:
    set_item(server.memcache_port, "victim", b"precious")
    s = conn(server.memcache_port)
    # A key with a space: taken by position, the length would be the exptime (0), the rest commands.
    s.sendall(b"set my queue 0 0 17\r\nXXdelete victim\r\n\r\nget victim\r\n")
    reply = s.recv(4096)
    assert reply == (b"CLIENT_ERROR usage: set <queue> <flags> <exptime> <bytes> [noreply] "
                     b"(closing: the item's length is unknown)\r\n")
    assert closed_by_server(s)
    assert get_item(server.memcache_port, "victim") == b"VALUE victim 0 8\r\nprecious\r\nEND\r\n"


def test_refused_set_header_skips_its_announced_data(server: ServerProcess) -> None:
    set_item(server.memcache_port, "victim", b"precious")
    s = conn(server.memcache_port)
    # a bad exptime with a readable length: the 8 data bytes are dropped, the next line is a command
    reply = exchange(s, b"set victim 0 abc 8\r\nshutdown\r\nversion\r\n", b"\r\nVERSION 2.4.1-py0.1.0\r\n")
    assert reply.startswith(b"CLIENT_ERROR bad exptime 'abc'") and reply.endswith(b"VERSION 2.4.1-py0.1.0\r\n")
    assert server.proc is not None and server.proc.poll() is None
    assert get_item(server.memcache_port, "victim") == b"VALUE victim 0 8\r\nprecious\r\nEND\r\n"


@pytest.mark.parametrize("header", [b"add victim 0 0 %d", b"replace victim 0 0 %d", b"append victim 0 0 %d",
                                    b"prepend victim 0 0 %d", b"cas victim 0 0 %d 1"])
def test_unsupported_storage_commands_never_run_their_data(server: ServerProcess, header: bytes) -> None:
    set_item(server.memcache_port, "victim", b"precious")
    data = b"flush victim"
    s = conn(server.memcache_port)
    reply = exchange(s, header % len(data) + b"\r\n" + data + b"\r\nget nothing_here\r\n", b"END\r\n")
    verb = header.split()[0]
    assert reply.startswith(b"CLIENT_ERROR " + verb + b" is not supported")
    assert reply.endswith(b"\r\nEND\r\n") and reply.count(b"\r\n") == 2  # the data ran as nothing
    assert get_item(server.memcache_port, "victim") == b"VALUE victim 0 8\r\nprecious\r\nEND\r\n"


def test_the_fuzz_seeds_hold_every_unsupported_storage_verb_and_the_server_drops_their_data(
        server: ServerProcess) -> None:
    from tests.support.fuzz_harness import memcache_seeds

    storage = [seed for seed in memcache_seeds() if seed.split()[0] in STORAGE_VERBS]
    assert {seed.split()[0] for seed in storage} == STORAGE_VERBS
    s = conn(server.memcache_port)
    for seed in storage:
        reply = exchange(s, seed + b"version\r\n", b"VERSION 2.4.1-py0.1.0\r\n")
        error, rest = reply.split(b"\r\n", 1)  # an error even with noreply, as memcached answers
        assert error.startswith(b"CLIENT_ERROR " + seed.split()[0] + b" is not supported"), seed
        assert rest == b"VERSION 2.4.1-py0.1.0\r\n", seed  # the data block ran as nothing


STORAGE_VERBS = {b"add", b"replace", b"append", b"prepend", b"cas"}


def test_out_of_range_expiry_is_a_client_error(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    reply = exchange(s, b"set e 0 9223372036854776 1\r\nx\r\n")
    assert reply == b"CLIENT_ERROR exptime 9223372036854776 out of range -2147483648..4294967295\r\n"
    assert exchange(s, b"set e 0 4294967295 1\r\nx\r\n") == b"STORED\r\n"
    assert exchange(s, b"get e\r\n", b"END\r\n") == b"VALUE e 0 1\r\nx\r\nEND\r\n"
    assert "Traceback" not in server.log() and "struct.error" not in server.log()


def test_a_length_with_a_plus_frames_its_data_as_kestrel_reads_it(server: ServerProcess) -> None:
    # naggati's codec reads <bytes> with parseInt: `+5` is 5, and the line after the data a command.
    s = conn(server.memcache_port)
    assert exchange(s, b"set plus +0 +0 +5\r\nhello\r\nversion\r\n", b"VERSION 2.4.1-py0.1.0\r\n") == (
        b"STORED\r\nVERSION 2.4.1-py0.1.0\r\n")
    assert exchange(s, b"get plus/t=+10\r\n", b"END\r\n") == b"VALUE plus/t=+10 0 5\r\nhello\r\nEND\r\n"


# ---------------------------------------------------------------------------------------------
# Idle and slow clients, capped waits


def test_idle_client_is_closed_after_client_timeout(server_factory: Any) -> None:
    srv = server_factory({"client_timeout": "100ms"})
    s = conn(srv.memcache_port)
    start = time.monotonic()  # before the request: the idle time starts after it, however late this client runs
    assert exchange(s, b"version\r\n").startswith(b"VERSION ")
    assert closed_by_server(s)
    assert 0.08 < time.monotonic() - start < STALL_S


def test_a_client_that_stops_reading_is_closed_after_client_timeout(server_factory: Any) -> None:
    """Its replies fill the socket buffers; the server waits for room at most client_timeout, serving
    the others meanwhile, then closes it. Peeks take nothing, so nothing is lost. (client_timeout is
    two seconds so that the others' five requests are surely answered before it runs out, however
    loaded the machine: a server that made them wait would answer them only after closing it.)"""
    srv = server_factory({"client_timeout": "2s"})
    item = bytes(range(256)) * 256  # 64 KB
    set_item(srv.memcache_port, "big", item)
    stuck = conn(srv.memcache_port)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(b"get big/peek\r\n" * 400)  # 25 MB of replies, never read
    started = time.monotonic()
    with conn(srv.memcache_port) as busy:
        for _ in range(5):
            assert exchange(busy, b"version\r\n").startswith(b"VERSION ")
    # Nobody waits for the stuck client: the others were served before it was closed.
    assert "closing a client that stopped reading its replies" not in srv.log()
    wait_until(lambda: "closing a client that stopped reading its replies" in srv.log(), "the stuck client to be closed")
    assert 1.5 < time.monotonic() - started < 2 + STALL_S
    assert get_item(srv.memcache_port, "big") == b"VALUE big 0 %d\r\n%s\r\nEND\r\n" % (len(item), item)


def test_client_timeout_null_keeps_idle_clients(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert not closed_by_server(s, wait=0.3)
    assert exchange(s, b"version\r\n").startswith(b"VERSION ")


def test_slowloris_request_is_closed_after_request_timeout(server_factory: Any) -> None:
    srv = server_factory({"request_timeout": "100ms"})
    slow = conn(srv.memcache_port)
    slow.sendall(b"get q")  # the first bytes of a request, then silence
    start = time.monotonic()
    assert closed_by_server(slow)
    assert time.monotonic() - start < STALL_S
    half_item = conn(srv.memcache_port)
    half_item.sendall(b"set q 0 0 10\r\nabc")
    assert closed_by_server(half_item)
    idle = conn(srv.memcache_port)  # an idle client is not a slow one: client_timeout is null
    assert not closed_by_server(idle, wait=0.3)


def test_waits_are_capped_by_max_wait(server_factory: Any) -> None:
    srv = server_factory({"max_wait": "100ms"})
    s = conn(srv.memcache_port)
    start = time.monotonic()
    assert exchange(s, b"get q/t=9999999999\r\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, b"monitor q 100000\r\n", b"END\r\n") == b"END\r\n"
    assert time.monotonic() - start < STALL_S


@pytest.mark.parametrize("period", [b"nan", b"inf", b"-1", b"1e9", b"0x10"])
def test_monitor_refuses_periods_that_are_not_seconds(server: ServerProcess, period: bytes) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"monitor q %s\r\n" % period).startswith(b"CLIENT_ERROR bad monitor period")


# ---------------------------------------------------------------------------------------------
# A waiting client that hangs up


@pytest.mark.parametrize("request_line", [b"get hang/t=60000\r\n", b"get hang/t=60000/open\r\n",
                                          b"monitor hang 60\r\n"])
def test_hang_up_during_a_wait_withdraws_the_waiter_at_once(server: ServerProcess, request_line: bytes) -> None:
    port = server.memcache_port
    waiter = conn(port)
    # an open read on another queue must come back as soon as the client goes
    set_item(port, "held", b"h")
    assert exchange(waiter, b"get held/open\r\n", b"END\r\n") == b"VALUE held/open 0 1\r\nh\r\nEND\r\n"
    waiter.sendall(request_line)
    wait_until(lambda: memcache_stats(port).get("queue_hang_waiters") == "1", "the get to wait")
    waiter.close()
    # At once, not at the end of its minute: within STALL_S (how soon is bench/bench_responsiveness.py's).
    wait_until(lambda: memcache_stats(port).get("queue_hang_waiters") == "0", "the waiter to be withdrawn",
               timeout=STALL_S)
    assert memcache_stats(port)["queue_held_open_transactions"] == "0"
    set_item(port, "hang", b"for the living")
    assert get_item(port, "hang") == b"VALUE hang 0 14\r\nfor the living\r\nEND\r\n"
    assert get_item(port, "held") == b"VALUE held 0 1\r\nh\r\nEND\r\n"


def test_input_sent_during_a_wait_is_answered_after_it(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    reply = exchange(s, b"get w/t=200\r\nversion\r\n", b"VERSION 2.4.1-py0.1.0\r\n")
    assert reply == b"END\r\nVERSION 2.4.1-py0.1.0\r\n"


# ---------------------------------------------------------------------------------------------
# Kestrel's replies


def test_gets_answers_with_a_cas_field(server: ServerProcess) -> None:
    set_item(server.memcache_port, "q", b"hi")
    s = conn(server.memcache_port)
    assert exchange(s, b"gets q\r\n", b"END\r\n") == b"VALUE q 0 2 0\r\nhi\r\nEND\r\n"


def test_multi_key_get_serves_the_first_key_then_end(server: ServerProcess) -> None:
    set_item(server.memcache_port, "a", b"1")
    set_item(server.memcache_port, "b", b"2")
    s = conn(server.memcache_port)
    assert exchange(s, b"get a b\r\n", b"END\r\n") == b"VALUE a 0 1\r\n1\r\nEND\r\n"
    assert exchange(s, b"get b a\r\n", b"END\r\n") == b"VALUE b 0 1\r\n2\r\nEND\r\n"


def test_noreply_is_honoured_by_every_command(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    quiet = (b"set n 0 0 1 noreply\r\nx\r\nflush_all noreply\r\nflush_all 0 noreply\r\nflush n noreply\r\n"
             b"delete n noreply\r\ndelete n 0 noreply\r\nflush_expired n noreply\r\nflush_all_expired noreply\r\n"
             b"confirm n 1 noreply\r\nreload noreply\r\n")
    assert exchange(s, quiet + b"version\r\n") == b"VERSION 2.4.1-py0.1.0\r\n"
    # refusals are not answered either: the client reads no reply
    refused = b"status readonly\r\nset n 0 0 1 noreply\r\nx\r\nflush n noreply\r\nstatus up\r\n"
    assert exchange(s, refused + b"version\r\n", b"VERSION 2.4.1-py0.1.0\r\n") == b"END\r\nEND\r\nVERSION 2.4.1-py0.1.0\r\n"


def test_version_has_a_major_version_libmemcached_accepts(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    reply = exchange(s, b"version\r\n").decode()
    major, minor, micro = reply.removeprefix("VERSION ").split(".", 2)
    assert int(major) >= 1 and minor.isdigit() and micro[0].isdigit()


def test_binary_protocol_request_gets_an_error_and_a_close(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    # a binary GET of key "q": magic 0x80, opcode 0x00, key length 1, body length 1, opaque 0xDEADBEEF
    request = bytes([0x80, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0xDE, 0xAD, 0xBE, 0xEF]) + bytes(8) + b"q"
    s.sendall(request)
    header = b""
    while len(header) < 24:
        chunk = s.recv(24 - len(header))
        assert chunk, "closed before the error response"
        header += chunk
    assert header[0] == 0x81 and header[1] == 0 and header[6:8] == b"\x00\x83"
    assert header[12:16] == b"\xde\xad\xbe\xef"
    body_length = int.from_bytes(header[8:12], "big")
    body = b""
    while len(body) < body_length:
        body += s.recv(body_length - len(body))
    assert body == b"binary protocol not supported: use the memcache text protocol"
    assert closed_by_server(s)


def test_unknown_command_is_a_client_error_and_closes(server: ServerProcess) -> None:
    """What follows an unknown command may be its data: memcached's meta set `ms`, whose item here
    would flush every queue, runs nothing."""
    s = conn(server.memcache_port)
    assert exchange(s, b"set jobs 0 0 3\r\njob\r\n") == b"STORED\r\n"
    assert exchange(s, b"ms jobs 11 T0\r\nflush_all\r\n\r\nget jobs\r\n") == (b"CLIENT_ERROR unknown command 'ms' (closing: its data, if any, cannot be told "
                            b"from commands)\r\n")
    assert closed_by_server(s)
    s = conn(server.memcache_port)
    assert exchange(s, b"get jobs\r\n", b"END\r\n") == b"VALUE jobs 0 3\r\njob\r\nEND\r\n"


def test_status_without_a_status_file_answers_error(server_factory: Any) -> None:
    srv = server_factory({"status_file": None})
    s = conn(srv.memcache_port)
    assert exchange(s, b"status\r\n") == b"ERROR\r\n"
    assert exchange(s, b"status readonly\r\n") == b"ERROR\r\n"
    assert exchange(s, b"set still 0 0 1\r\nx\r\n") == b"STORED\r\n"


def test_plain_get_beside_an_open_read_is_an_error_that_closes(server: ServerProcess) -> None:
    set_item(server.memcache_port, "o", b"1")
    set_item(server.memcache_port, "o", b"2")
    s = conn(server.memcache_port)
    assert exchange(s, b"get o/open\r\n", b"END\r\n") == b"VALUE o/open 0 1\r\n1\r\nEND\r\n"
    assert exchange(s, b"get o\r\n") == b"ERROR\r\n"
    assert closed_by_server(s)
    # the close aborted the open read: item 1 is back at the head
    assert get_item(server.memcache_port, "o") == b"VALUE o 0 1\r\n1\r\nEND\r\n"


def test_monitor_stops_at_max_open_reads_and_counts_hits_not_gets(server_factory: Any) -> None:
    srv = server_factory({"max_open_reads": 2})
    port = srv.memcache_port
    for i in range(4):
        set_item(port, "m", b"%d" % i)
    gets_before = int(memcache_stats(port)["cmd_get"])
    s = conn(port)
    assert exchange(s, b"monitor m 1\r\n", b"END\r\n") == b"VALUE m 0 1\r\n0\r\nVALUE m 0 1\r\n1\r\nEND\r\n"
    # both reads are still open: a second monitor on the queue gets nothing more
    assert exchange(s, b"monitor m 1\r\n", b"END\r\n") == b"END\r\n"
    stats = memcache_stats(port)
    assert int(stats["cmd_get"]) == gets_before and stats["queue_m_open_transactions"] == "2"
    assert exchange(s, b"confirm m 2\r\n") == b"END\r\n"
    assert exchange(s, b"monitor m 1 1\r\n", b"END\r\n") == b"VALUE m 0 1\r\n2\r\nEND\r\n"


def test_flush_expired_and_flush_all_expired(server_factory: Any) -> None:
    srv = server_factory({"expiration_timer_frequency": 0})  # no background sweep
    s = conn(srv.memcache_port)
    # a negative exptime is already expired; each set first drops an expired head, so one per queue
    exchange(s, b"set x 0 -1 1\r\na\r\nset y 0 -1 1\r\nb\r\nset z 0 -1 1\r\nc\r\n", b"STORED\r\n" * 3)
    assert exchange(s, b"flush_expired x\r\n") == b"1\r\n"
    assert exchange(s, b"flush_expired x\r\n") == b"0\r\n"
    assert exchange(s, b"flush_all_expired\r\n") == b"2\r\n"
    assert memcache_stats(srv.memcache_port)["queue_y_expired_items"] == "1"


def test_dump_stats_of_named_queues(server: ServerProcess) -> None:
    set_item(server.memcache_port, "one", b"1")
    set_item(server.memcache_port, "two", b"2")
    s = conn(server.memcache_port)
    dump = exchange(s, b"dump_stats two\r\n", b"END\r\n").decode()
    assert dump.startswith("queue 'two' {\r\n") and "  items=1\r\n" in dump and "'one'" not in dump


def test_read_only_commands_do_not_create_queues(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    for line in (b"flush ghost\r\n", b"flush_expired ghost\r\n", b"dump_stats ghost\r\n", b"delete ghost\r\n",
                 b"confirm ghost 1\r\n", b"get ghost/close\r\n", b"get ghost/abort\r\n"):
        exchange(s, line, b"\r\n")
        stats = memcache_stats(server.memcache_port)
        assert not any(key.startswith("queue_ghost") for key in stats), line
        assert not (server.queue_path / "ghost").exists(), line


def test_full_queue_answers_not_stored(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"set full 0 0 1\r\n1\r\n") == b"STORED\r\n"
    assert exchange(s, b"set full 0 0 1\r\n2\r\n") == b"NOT_STORED\r\n"


def test_alias_with_a_refusing_destination_answers_not_stored(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"set both 0 0 1\r\n1\r\n") == b"STORED\r\n"
    assert exchange(s, b"set both 0 0 1\r\n2\r\n") == b"NOT_STORED\r\n"
    # an alias's figures, as Kestrel's AliasedQueue gives them: every item offered, taken or not
    stats = memcache_stats(server.memcache_port)
    assert (stats["queue_both_put_items"], stats["queue_both_put_bytes"]) == ("2", "2")
    assert stats["queue_both_children"] == "aliased_full"
    dump = exchange(s, b"dump_stats both\r\n", b"END\r\n").decode()
    assert dump == "queue 'both' {\r\n  put_items=2\r\n  put_bytes=2\r\n  children=aliased_full\r\n}\r\nEND\r\n"


def test_a_fanout_parent_names_its_children_and_every_queue_s_add_counts(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    for child in (b"fanned+b", b"fanned+a"):
        assert exchange(s, b"get %s\r\n" % child, b"END\r\n") == b"END\r\n"  # created
    before = int(memcache_stats(server.memcache_port)["total_items"])
    assert exchange(s, b"set fanned 0 0 1\r\nx\r\n") == b"STORED\r\n"
    stats = memcache_stats(server.memcache_port)
    assert stats["queue_fanned_children"] == "fanned+a,fanned+b"
    assert int(stats["total_items"]) == before + 3  # the parent's and each child's (Kestrel's count)
    assert float(stats["reserved_memory_ratio"]) >= 0
    dump = exchange(s, b"dump_stats fanned\r\n", b"END\r\n").decode()
    assert "  children=fanned+a,fanned+b\r\n}\r\nEND\r\n" in dump


def test_a_line_of_max_line_length_is_read_whichever_receive_its_line_end_comes_in(server_factory: Any) -> None:
    """As the text port reads it: a line's length does not count its line end."""
    srv = server_factory({"max_line_length": "1KB"})
    longest = b"get q" + b" q" * 509 + b"x"  # 1,024 bytes: only the first key counts, as in Kestrel
    assert len(longest) == 1024
    s = conn(srv.memcache_port)
    assert exchange(s, longest + b"\r\n", b"END\r\n") == b"END\r\n"
    s.sendall(longest + b"\r")
    time.sleep(0.1)  # the CR alone in its receive
    assert exchange(s, b"\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, longest + b"x\r\n") == b"CLIENT_ERROR line too long\r\n"
    assert closed_by_server(s)
