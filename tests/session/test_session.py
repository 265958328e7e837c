"""The session layer without sockets: the rules every protocol shares (status refusals, open reads
and their limits, auto-abort, waits with deadlines, stats), on a manual runtime whose clock the
tests move instead of sleeping. Waiting calls run in a greenlet; `gevent.sleep(0)` lets it run."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest
import structlog

from kestrel.service.config import ServerConfig
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import (
    GET_BYTES,
    GET_SLICE,
    ClientGone,
    OpenReadConflict,
    Session,
    SessionError,
    Watch,
)
from kestrel.service.session.status import Status
from kestrel.storage import QItem, QueueCollection, QueueConfigs
from kestrel.storage.errors import JournalWriteError, MemoryBudgetExceeded, RefusedByStatus
from kestrel.storage.runtime import ManualRuntime
from tests.storage.test_write_gate import LARGE, HeldWrites

MakeServer = Callable[..., ServerState]


@pytest.fixture
def runtime() -> ManualRuntime:
    return ManualRuntime()


@pytest.fixture
def make_server(tmp_path: Path, runtime: ManualRuntime) -> Iterator[MakeServer]:
    """A server on the manual runtime with the given settings (status file in the queue path)."""
    servers: list[ServerState] = []

    def make(**settings: Any) -> ServerState:
        server = ServerState(ServerConfig(queue_path=str(tmp_path / "queues"), **settings), runtime=runtime)
        server.collection.load()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()
    structlog.contextvars.clear_contextvars()  # each Session names its client in the log context


@pytest.fixture
def server(make_server: MakeServer) -> ServerState:
    return make_server(max_open_reads=3)


def _drain(server: ServerState, queue: str) -> list[bytes]:
    """What `queue` holds, head first (taken out past the session, so no counter moves)."""
    return [item.data for item in server.collection.remove(queue, 1_000_000)]


def _open_reads(server: ServerState, queue: str) -> int:
    return server.collection.queue(queue).stats()["open_transactions"]


# ---------------------------------------------------------------------------------------------
# Status


def test_read_only_refuses_every_write_and_still_serves_reads(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    session.set_status("readonly")
    writes: list[Callable[[], object]] = [
        lambda: session.put("q", [b"d"]), lambda: session.flush("q"), lambda: session.flush_expired("q"),
        session.flush_all_expired, session.flush_all, lambda: session.delete("q")]
    for write in writes:
        with pytest.raises(RefusedByStatus, match="refused: server is ReadOnly"):
            write()
    assert session.get("q") == [b"a"]
    head = session.peek("q")
    assert head is not None and head.data == b"b"
    assert session.get_items("q", 1).pairs() == [(b"b", 0)]
    assert _drain(server, "q") == [b"c"]


def test_quiescent_refuses_reads_but_open_reads_can_still_be_confirmed(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    session.put("r", [b"x", b"y"])
    [(_, read_id)] = session.get_items("q", 1, auto_abort_ms=60_000).pairs()
    assert session.get("r", open=True) == [b"x"]
    session.set_status(int(Status.QUIESCENT))  # as Thrift sends it
    reads: list[Callable[[], object]] = [
        lambda: session.get("q"), lambda: session.get("q", peek=True),
        lambda: session.get("q", abort=True), lambda: session.get_items("q", 1),
        lambda: session.abort_ids({read_id}), lambda: session.peek("q"), lambda: session.queue_info("q"),
        lambda: list(session.monitor("q", 1_000)), lambda: session.put("q", [b"d"])]
    for read in reads:
        with pytest.raises(RefusedByStatus, match="refused: server is Quiescent"):
            read()
    assert session.confirm_ids({read_id}) == 1
    assert session.get("r", close=True) == []  # a memcache close alone is a confirm
    assert _open_reads(server, "q") == _open_reads(server, "r") == 0
    assert _drain(server, "q") == [b"b", b"c"] and _drain(server, "r") == [b"y"]


def test_a_stricter_status_bites_after_the_grace_period_on_the_servers_clock(
        make_server: MakeServer, runtime: ManualRuntime) -> None:
    session = Session(make_server(status_change_grace_period=1_000), "client")
    session.set_status("readonly")
    assert session.current_status() == Status.READ_ONLY
    runtime.advance(999)
    assert session.put("q", [b"a"]) == 1  # Up is enforced until the grace period ends
    runtime.advance(1)
    with pytest.raises(RefusedByStatus, match="server is ReadOnly"):
        session.put("q", [b"b"])


def test_an_unknown_status_is_the_clients_error(server: ServerState) -> None:
    session = Session(server, "client")
    with pytest.raises(SessionError, match="unknown status 'sideways'"):
        session.set_status("sideways")
    assert session.current_status() == Status.UP


# ---------------------------------------------------------------------------------------------
# Memcache-style open reads


def test_close_confirms_an_open_read_and_abort_puts_it_back_at_the_head(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    assert session.get("q", open=True) == [b"a"]
    assert _open_reads(server, "q") == 1
    assert session.get("q", close=True, open=True) == [b"b"]  # confirm a, open b
    assert session.get("q", abort=True) == []  # b goes back
    assert _open_reads(server, "q") == 0
    assert _drain(server, "q") == [b"b", b"c"]


def test_a_connection_holds_one_open_read_per_queue(server: ServerState) -> None:
    session, other = Session(server, "client"), Session(server, "other")
    session.put("q", [b"a", b"b", b"c"])
    session.put("r", [b"x"])
    assert session.get("q", open=True) == [b"a"]
    with pytest.raises(SessionError, match="already have an open read on this queue") as opened:
        session.get("q", open=True)
    assert type(opened.value) is SessionError
    with pytest.raises(OpenReadConflict):  # memcache answers ERROR and closes the connection
        session.get("q")
    assert session.get("q", peek=True) == [b"b"]  # a peek takes nothing: allowed
    assert session.get("r", open=True) == [b"x"]  # another queue: allowed
    assert other.get("q", open=True) == [b"b"]  # another connection: allowed
    assert session.confirm_reads("q") == 1
    assert session.get("q", open=True) == [b"c"]


def test_an_open_read_of_a_queue_deleted_since_stands_in_the_way_of_no_get(server: ServerState) -> None:
    """The read went with the deleted queue's items (docs/sessions.md), yet the next `/open` on a
    queue made anew under its name was refused ("already have an open read"), and a plain get
    raised OpenReadConflict, which closes a memcache connection."""
    session, other = Session(server, "client"), Session(server, "other")
    for plain in (False, True):
        session.put("q", [b"old"])
        assert session.get("q", open=True) == [b"old"]
        other.delete("q")
        other.put("q", [b"new"])
        assert session.get("q", open=not plain) == [b"new"]
        assert session.confirm_reads("q") == (0 if plain else 1)
        assert _drain(server, "q") == []
        other.delete("q")


def test_monitor_opens_reads_up_to_max_open_reads(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"1", b"2", b"3", b"4", b"5"])
    assert list(session.monitor("q", 1_000)) == [b"1", b"2", b"3"]  # max_open_reads: 3
    assert list(session.monitor("q", 1_000)) == []  # no room left on this queue
    assert session.confirm_reads("q", 2) == 2  # the oldest two
    assert list(session.monitor("q", 1_000, max_items=1)) == [b"4"]
    assert session.confirm_reads("q", 3) == 0  # more than are open: none (Kestrel's ItemIdList.pop)
    assert session.confirm_reads("q", 0) == 0
    session.abort_pending("q")  # the oldest, 3, goes back: one, as Kestrel's abortRead (and `/close`)
    assert _drain(server, "q") == [b"3", b"5"]
    assert session.confirm_reads("q") == 1  # 4 was still open
    assert server.stats.get_hits == 4 and server.stats.cmd_get == 0


def test_a_closed_connection_aborts_its_open_reads_to_the_head(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    session.put("r", [b"x"])
    assert list(session.monitor("q", 1_000, max_items=2)) == [b"a", b"b"]
    assert session.get("r", open=True) == [b"x"]
    assert server.stats.curr_connections == 1
    session.close()
    session.close()  # a second close changes nothing
    assert server.stats.curr_connections == 0 and server.stats.total_connections == 1
    assert _open_reads(server, "q") == 0
    assert _drain(server, "q") == [b"a", b"b", b"c"] and _drain(server, "r") == [b"x"]


@pytest.mark.pure_build
def test_a_closing_connection_counts_until_its_open_reads_are_back(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"a"])
    assert session.get("q", open=True) == [b"a"]
    counted: list[int] = []
    give_back = session._return_reads

    def counting_return(queues: list[str]) -> None:
        counted.append(server.stats.curr_connections)
        give_back(queues)

    session._return_reads = counting_return  # type: ignore[method-assign]
    session.close()
    assert counted == [1] and server.stats.curr_connections == 0


# ---------------------------------------------------------------------------------------------
# Thrift-style open reads: by id, capped per connection and queue, aborted by their timer


def test_max_open_reads_caps_each_queue_of_each_connection(server: ServerState) -> None:
    session, other = Session(server, "client"), Session(server, "other")
    session.put("q", [b"%d" % i for i in range(8)])
    session.put("r", [b"x"])
    reads = session.get_items("q", 10, auto_abort_ms=60_000).pairs()
    assert [data for data, _ in reads] == [b"0", b"1", b"2"]  # max_open_reads: 3
    assert session.get_items("q", 10, auto_abort_ms=60_000).pairs() == []
    assert session.get_items("q", 1).pairs() == [(b"3", 0)]  # without auto-abort nothing stays open
    assert len(session.get_items("r", 10, auto_abort_ms=60_000).pairs()) == 1  # another queue
    assert len(other.get_items("q", 2, auto_abort_ms=60_000).pairs()) == 2  # another connection
    assert session.confirm_ids({reads[0][1]}) == 1
    assert [data for data, _ in session.get_items("q", 10, auto_abort_ms=60_000).pairs()] == [b"6"]


def test_uncapped_get_items_opens_past_max_open_reads(server: ServerState) -> None:
    session = Session(server, "client")
    session.put("q", [b"%d" % i for i in range(8)])
    assert len(session.get_items("q", 10, auto_abort_ms=60_000).pairs()) == 3  # max_open_reads: 3
    uncapped = session.get_items("q", 4, auto_abort_ms=60_000, create=False, capped=False).pairs()
    assert [data for data, _ in uncapped] == [b"3", b"4", b"5", b"6"]
    assert session.confirm_ids({read_id for _, read_id in uncapped}) == 4


def test_get_items_is_capped_by_max_batch_items(make_server: MakeServer) -> None:
    session = Session(make_server(max_batch_items=2), "client")
    session.put("q", [b"a", b"b", b"c"])
    assert session.get_items("q", 10).pairs() == [(b"a", 0), (b"b", 0)]
    for none in (0, -1):  # (Kestrel's loop, counting down to 0, drains the queue for -1)
        assert session.get_items("q", none, auto_abort_ms=1_000).pairs() == []
    assert _drain(session.server, "q") == [b"c"]


@pytest.mark.parametrize("auto_abort_ms", [0, 60_000])
def test_a_large_get_lets_the_others_run_between_its_slices(make_server: MakeServer, auto_abort_ms: int) -> None:
    server = make_server(max_open_reads=4 * GET_SLICE)
    pauses: list[int] = []
    session = Session(server, "client", pause=lambda: pauses.append(_open_reads(server, "q")))
    datas = [b"%06d" % n for n in range(2 * GET_SLICE + 5)]
    session.put("q", datas)
    taken = session.get_items("q", len(datas), auto_abort_ms=auto_abort_ms)
    assert taken.data() == datas and len(pauses) >= 2
    if auto_abort_ms:  # each slice's reads were opened before the pause that followed it
        assert pauses[:2] == [GET_SLICE, 2 * GET_SLICE]
        assert session.confirm_ids(set(taken.ids)) == len(datas)  # type: ignore[arg-type]
    assert server.collection.queue("q").stats()["items"] == 0


@pytest.mark.pure_build
@pytest.mark.parametrize("auto_abort_ms", [0, 60_000])
def test_a_fault_part_way_through_a_large_get_puts_back_the_slices_taken(
        server: ServerState, monkeypatch: pytest.MonkeyPatch, auto_abort_ms: int) -> None:
    session = Session(server, "client")
    datas = [b"%06d" % n for n in range(GET_SLICE + 5)]
    session.put("q", datas)
    q = server.collection.queue("q")
    take = q.remove
    calls: list[int] = []

    def failing_second(count: int = 1, transaction: bool = False, timeout: float = 0.0,
                       held: bool = False, max_bytes: int = GET_BYTES) -> list[Any]:
        calls.append(count)
        if len(calls) == 2:
            raise JournalWriteError("q", "q", OSError(errno.ENOSPC, "No space left on device"))
        return take(count, transaction, timeout, held, max_bytes)

    monkeypatch.setattr(q, "remove", failing_second)
    with pytest.raises(JournalWriteError):  # the fault is the answer; the slice taken goes back
        session.get_items("q", len(datas), auto_abort_ms=auto_abort_ms, capped=False)
    monkeypatch.undo()
    assert (_open_reads(server, "q"), len(server.reads_by_id._reads)) == (0, 0)
    stats = server.collection.queue("q").stats()
    assert (stats["canceled_transactions"], stats["transactions"]) == (0, GET_SLICE if auto_abort_ms else 0)
    assert _drain(server, "q") == datas


@pytest.mark.pure_build
@pytest.mark.parametrize("auto_abort_ms", [0, 60_000])
def test_a_fault_in_a_get_s_closing_step_puts_back_what_it_took(
        server: ServerState, runtime: ManualRuntime, monkeypatch: pytest.MonkeyPatch, auto_abort_ms: int) -> None:
    """The confirm (no auto-abort) or the read ids (auto-abort) that end a get that waited fail:
    the fault is the answer and the items go back."""
    session, producer = Session(server, "client"), Session(server, "producer")
    producer.put("q", [b"a", b"b"])

    def failing(*args: Any) -> Any:
        raise JournalWriteError("q", "q", OSError(errno.ENOSPC, "No space left on device"))

    if auto_abort_ms:
        monkeypatch.setattr(server.reads_by_id, "open_many", failing)
    else:
        monkeypatch.setattr(server.collection, "confirm", failing)
    getter = gevent.spawn(partial(session.get_items, "q", 3, timeout_ms=500, auto_abort_ms=auto_abort_ms, capped=False))
    gevent.sleep(0)
    runtime.advance(500)
    gevent.sleep(0)
    assert isinstance(getter.exception, JournalWriteError)
    monkeypatch.undo()
    assert _open_reads(server, "q") == 0 and _drain(server, "q") == [b"a", b"b"]


@pytest.mark.parametrize("auto_abort_ms", [0, 60_000])
def test_a_get_killed_between_its_slices_puts_back_what_it_took(
        make_server: MakeServer, auto_abort_ms: int) -> None:
    server = make_server(max_open_reads=4 * GET_SLICE)
    session = Session(server, "client", pause=gevent.sleep)  # lets the others run: here, the kill
    datas = [b"%06d" % n for n in range(2 * GET_SLICE + 5)]
    session.put("q", datas)
    getter = gevent.spawn(partial(session.get_items, "q", len(datas), auto_abort_ms=auto_abort_ms))
    gevent.sleep(0)
    assert _open_reads(server, "q") == GET_SLICE  # the first slice, held by the get
    getter.kill()  # the server stopping, say
    assert getter.dead and (_open_reads(server, "q"), len(server.reads_by_id._reads)) == (0, 0)
    assert _drain(server, "q") == datas


@pytest.mark.parametrize("auto_abort_ms", [0, 60_000])
def test_a_get_whose_client_hangs_up_while_it_waits_for_more_puts_back_what_it_took(
        make_server: MakeServer, runtime: ManualRuntime, auto_abort_ms: int) -> None:
    """Back without an error counted: a get that replied nothing delivered nothing, so even
    `max_errors: 1` makes none of them poison."""
    server = make_server(queues=QueueConfigs({}, {"q": {"max_errors": 1}}))
    session, producer = Session(server, "client"), Session(server, "producer")
    producer.put("q", [b"a", b"b"])
    getter = gevent.spawn(partial(session.get_items, "q", 5, timeout_ms=10_000, auto_abort_ms=auto_abort_ms))
    gevent.sleep(0)
    assert session.waiting and _open_reads(server, "q") == 2
    producer.put("q", [b"c"])  # taken too, and the get waits on
    gevent.sleep(0)
    assert session.waiting and _open_reads(server, "q") == 3
    session.client_gone()
    getter.kill(ClientGone)  # what the connection does while `waiting` says it may
    assert isinstance(getter.exception, ClientGone)
    stats = server.collection.queue("q").stats()
    assert (stats["open_transactions"], stats["canceled_transactions"], stats["items"]) == (0, 0, 3)
    runtime.advance(60_000)  # no auto-abort left to come
    assert _drain(server, "q") == [b"a", b"b", b"c"]


def test_a_get_short_of_items_by_an_expired_head_holds_what_it_took_while_it_waits(
        server: ServerState, runtime: ManualRuntime) -> None:
    """Three items for a get of three, but the head expires: the get takes two and waits on, and its
    client's hang-up puts them back."""
    session, producer = Session(server, "client"), Session(server, "producer")
    producer.put("q", [b"stale"], producer.expiry_after(100))
    producer.put("q", [b"a", b"b"])
    runtime.advance(100)
    getter = gevent.spawn(partial(session.get_items, "q", 3, timeout_ms=10_000))
    gevent.sleep(0)
    assert session.waiting and _open_reads(server, "q") == 2
    session.client_gone()
    getter.kill(ClientGone)
    assert _drain(server, "q") == [b"a", b"b"]


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_get_that_waited_removes_its_items_for_good_once_it_replies(
        make_server: MakeServer, runtime: ManualRuntime, tmp_path: Path, journal_format: str) -> None:
    """Confirmed when the get replies: nothing open after it, none back after a restart, and no
    transaction counted (none was asked for)."""
    server = make_server(queues=QueueConfigs({"journal_format": journal_format}))
    session, producer = Session(server, "client"), Session(server, "producer")
    producer.put("q", [b"a", b"b", b"kept"])
    assert session.get_items("q", 2, timeout_ms=500).data() == [b"a", b"b"]
    getter = gevent.spawn(partial(session.get_items, "q", 3, timeout_ms=500))
    gevent.sleep(0)
    runtime.advance(500)
    gevent.sleep(0)
    assert getter.value.data() == [b"kept"]
    stats = server.collection.queue("q").stats()
    assert (stats["open_transactions"], stats["transactions"], stats["items"]) == (0, 0, 0)
    producer.put("q", [b"after"])
    server.close()
    again = make_server(queues=QueueConfigs({"journal_format": journal_format}))
    assert _drain(again, "q") == [b"after"]


def test_auto_abort_puts_the_items_back_at_the_head_when_its_time_comes(
        server: ServerState, runtime: ManualRuntime) -> None:
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    reads = session.get_items("q", 2, auto_abort_ms=1_000).pairs()
    assert [data for data, _ in reads] == [b"a", b"b"] and all(read_id > 0 for _, read_id in reads)
    runtime.advance(999)
    assert _open_reads(server, "q") == 2
    runtime.advance(1)
    assert _open_reads(server, "q") == 0
    assert session.confirm_ids({read_id for _, read_id in reads}) == 0  # too late
    assert _drain(server, "q") == [b"a", b"b", b"c"]


def test_reads_by_id_outlive_their_connection_and_close_from_any_other(
        server: ServerState, runtime: ManualRuntime) -> None:
    session, other = Session(server, "client"), Session(server, "other")
    session.put("q", [b"a", b"b", b"c"])
    [(_, first), (_, second)] = session.get_items("q", 2, auto_abort_ms=1_000).pairs()
    session.close()
    assert _open_reads(server, "q") == 2  # closing the connection does not abort them
    assert other.confirm_ids({first}) == 1
    assert other.abort_ids({second, 12345}) == 1
    assert _open_reads(server, "q") == 0
    runtime.advance(1_000)  # the timer finds nothing left to abort
    assert _drain(server, "q") == [b"b", b"c"]


def test_ids_close_their_reads_in_their_own_queues_in_one_call(server: ServerState) -> None:
    """The queue a Thrift confirm or abort names is not asked, as in Kestrel (`closePendingReads`):
    a client that names another queue still closes its reads."""
    session = Session(server, "client")
    session.put("q", [b"q1", b"q2"])
    session.put("r", [b"r1", b"r2"])
    q_ids = session.get_items("q", 2, auto_abort_ms=1_000).ids
    r_ids = session.get_items("r", 2, auto_abort_ms=1_000).ids
    assert isinstance(q_ids, list) and isinstance(r_ids, list)
    assert session.confirm_ids({q_ids[0], r_ids[0]}) == 2
    assert session.abort_ids({q_ids[1], r_ids[1]}) == 2
    assert _open_reads(server, "q") == _open_reads(server, "r") == 0
    assert _drain(server, "q") == [b"q2"] and _drain(server, "r") == [b"r2"]


def _refusing(server: ServerState, monkeypatch: pytest.MonkeyPatch, queue: str) -> None:
    """The collection's confirm and return of `queue`'s reads fail as a full disk fails them."""
    coll = server.collection
    for name in ("confirm", "unremove"):
        real = getattr(coll, name)

        def refused(q: str, *args: Any, real: Callable[..., int] = real, **kwargs: Any) -> int:
            if q == queue:
                raise JournalWriteError(q, q, OSError(errno.ENOSPC, "No space left on device"))
            return real(q, *args, **kwargs)

        monkeypatch.setattr(coll, name, refused)


@pytest.mark.pure_build  # (compiled, the collection's methods cannot be replaced)
@pytest.mark.parametrize("confirm", [True, False], ids=["confirm", "abort"])
def test_reads_closed_by_id_in_a_queue_whose_journal_refuses_leave_the_other_queues_closed(
        server: ServerState, monkeypatch: pytest.MonkeyPatch, confirm: bool) -> None:
    """One call closes reads of two queues, the first of whose journal refuses: the other queue's
    reads are closed all the same, the error answers the call, and a refused confirm's reads stay
    open and held by their ids, confirmed by a later call. Taken from their holder first, the
    other queue's reads and the refused ones stayed open with nobody to close them."""
    session = Session(server, "client")
    session.put("q", [b"q1"])
    session.put("r", [b"r1"])
    r_ids = session.get_items("r", 1, auto_abort_ms=60_000).ids
    q_ids = session.get_items("q", 1, auto_abort_ms=60_000).ids  # newer: closed first
    assert isinstance(q_ids, list) and isinstance(r_ids, list)
    _refusing(server, monkeypatch, "q")
    close = session.confirm_ids if confirm else session.abort_ids
    with pytest.raises(JournalWriteError):
        close({*q_ids, *r_ids})
    monkeypatch.undo()
    assert _open_reads(server, "r") == 0
    assert _drain(server, "r") == ([] if confirm else [b"r1"])
    if confirm:
        assert _open_reads(server, "q") == 1 and session.confirm_ids(set(q_ids)) == 1
        assert _open_reads(server, "q") == 0 and _drain(server, "q") == []


@pytest.mark.pure_build  # (compiled, the collection's methods cannot be replaced)
def test_a_refused_confirm_of_a_connection_s_reads_leaves_them_held_by_it(
        server: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text `confirm` (or `get q/close`) whose journal refuses: the reads stay the connection's,
    oldest first, to be confirmed again or aborted when it closes."""
    session = Session(server, "client")
    session.put("q", [b"a", b"b", b"c"])
    assert list(session.monitor("q", 1_000, max_items=2)) == [b"a", b"b"]
    _refusing(server, monkeypatch, "q")
    with pytest.raises(JournalWriteError):
        session.confirm_reads("q", 1)
    monkeypatch.undo()
    assert list(session.monitor("q", 1_000, max_items=1)) == [b"c"]
    assert session.confirm_reads("q", 1) == 1  # the oldest, `a`, refused before
    session.close()
    assert _drain(server, "q") == [b"b", b"c"]


@pytest.mark.pure_build  # (compiled, the collection's methods cannot be replaced)
def test_a_closed_connection_returns_every_queue_s_reads_though_one_s_journal_refuses(
        server: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reads of the queues after one whose journal refuses their return go back all the same."""
    session = Session(server, "client")
    session.put("q", [b"q1"])
    session.put("r", [b"r1"])
    assert session.get("q", open=True) == [b"q1"] and session.get("r", open=True) == [b"r1"]
    _refusing(server, monkeypatch, "q")
    with pytest.raises(JournalWriteError):
        session.close()
    monkeypatch.undo()
    assert _open_reads(server, "r") == 0 and _drain(server, "r") == [b"r1"]


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_reads_of_a_deleted_queue_close_nothing_of_the_queue_created_under_its_name(
        make_server: MakeServer, runtime: ManualRuntime, journal_format: str) -> None:
    """A queue created again after a delete starts its xids again: the reads opened on the deleted
    one (their items gone with it) confirm and abort nothing of the new one, whose reads stay
    open until their own clients close them, by a confirm, an abort, a disconnect or a timer."""
    server = make_server(max_open_reads=3, queues=QueueConfigs({"journal_format": journal_format}))
    old, new, admin = Session(server, "old"), Session(server, "new"), Session(server, "admin")
    admin.put("q", [b"gone 1"])
    admin.put("r", [b"gone 2"])
    assert old.get("q", open=True) == [b"gone 1"]
    [(_, stale_id)] = old.get_items("r", 1, auto_abort_ms=1_000).pairs()
    admin.delete("q")
    admin.delete("r")
    admin.put("q", [b"kept 1"])
    admin.put("r", [b"kept 2"])
    assert new.get("q", open=True) == [b"kept 1"]
    [(_, kept_id)] = new.get_items("r", 1, auto_abort_ms=60_000).pairs()
    assert old.confirm_reads("q") == 0  # its read went with the deleted queue
    assert old.confirm_ids({stale_id}) == 0
    assert _open_reads(server, "q") == _open_reads(server, "r") == 1  # the new reads are untouched
    assert old.get("q", open=True) == []  # nothing else to take: the new read is still open
    old.close()  # aborts what it holds: nothing of the new queue
    runtime.advance(1_000)  # the stale read's timer: nothing of the new queue either
    assert _open_reads(server, "q") == _open_reads(server, "r") == 1
    assert new.confirm_ids({kept_id}) == 1
    new.close()  # its read of `q` goes back
    assert _drain(server, "q") == [b"kept 1"] and _drain(server, "r") == []


def test_a_large_get_takes_no_slice_from_a_queue_created_after_its_queue_was_deleted(
        make_server: MakeServer) -> None:
    server = make_server(max_open_reads=4 * GET_SLICE)
    admin = Session(server, "admin")

    def delete_and_create_again() -> None:
        if server.collection.queue("q").stats()["items"] == GET_SLICE:  # after the first slice
            admin.delete("q")
            admin.put("q", [b"new %d" % n for n in range(GET_SLICE)])

    session = Session(server, "client", pause=delete_and_create_again)
    session.put("q", [b"old %d" % n for n in range(2 * GET_SLICE)])
    taken = session.get_items("q", 2 * GET_SLICE, auto_abort_ms=60_000)
    assert taken.data() == [b"old %d" % n for n in range(GET_SLICE)]
    assert session.abort_ids(set(taken.ids)) == 0  # type: ignore[arg-type]
    assert _drain(server, "q") == [b"new %d" % n for n in range(GET_SLICE)]


# ---------------------------------------------------------------------------------------------
# Waits with deadlines


def test_a_get_with_a_timeout_comes_back_empty_at_its_deadline(
        server: ServerState, runtime: ManualRuntime) -> None:
    session = Session(server, "client")
    timers = runtime.timers  # the server's own (the commit log's checkpoints)
    waiter = gevent.spawn(partial(session.get, "q", timeout_ms=500))
    gevent.sleep(0)
    assert session.waiting and server.collection.queue("q").waiters == 1
    runtime.advance(499)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    gevent.sleep(0)
    assert waiter.ready() and waiter.value == []
    assert not session.waiting and server.collection.queue("q").waiters == 0 and runtime.timers == timers
    assert server.stats.get_misses == 1


def test_a_waiting_get_is_served_by_an_item_put_before_its_deadline(
        server: ServerState, runtime: ManualRuntime) -> None:
    session, producer = Session(server, "client"), Session(server, "producer")
    timers = runtime.timers  # the server's own (the commit log's checkpoints)
    waiter = gevent.spawn(partial(session.get, "q", timeout_ms=500, open=True))
    gevent.sleep(0)
    runtime.advance(400)
    producer.put("q", [b"a"])
    gevent.sleep(0)
    assert waiter.ready() and waiter.value == [b"a"]
    assert session.reads.holds("q") and runtime.timers == timers
    assert server.stats.get_hits == 1


def test_a_thrift_get_waits_for_the_rest_of_its_items_until_its_deadline(
        server: ServerState, runtime: ManualRuntime) -> None:
    session, producer = Session(server, "client"), Session(server, "producer")
    waiter = gevent.spawn(partial(session.get_items, "q", 2, 1_000))
    gevent.sleep(0)
    runtime.advance(100)
    producer.put("q", [b"a"])
    gevent.sleep(0)
    assert not waiter.ready()  # one of two: it waits on for the second
    runtime.advance(899)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    gevent.sleep(0)
    assert waiter.ready() and waiter.value.pairs() == [(b"a", 0)]


def test_monitor_keeps_one_deadline_for_all_its_items(server: ServerState, runtime: ManualRuntime) -> None:
    session, producer = Session(server, "client"), Session(server, "producer")
    monitor = gevent.spawn(lambda: list(session.monitor("q", 1_000)))
    gevent.sleep(0)
    runtime.advance(300)
    producer.put("q", [b"a"])
    gevent.sleep(0)
    runtime.advance(699)
    gevent.sleep(0)
    assert not monitor.ready()
    runtime.advance(1)
    gevent.sleep(0)
    assert monitor.ready() and monitor.value == [b"a"]
    assert session.reads.holds("q") and server.stats.get_misses == 1


@pytest.mark.parametrize("get", [
    lambda session: session.get("q", timeout_ms=60_000),
    lambda session: session.get_items("q", 1, 60_000),
    lambda session: list(session.monitor("q", 60_000)),
])
def test_every_wait_is_capped_by_max_wait(make_server: MakeServer, runtime: ManualRuntime,
                                          get: Callable[[Session], object]) -> None:
    session = Session(make_server(max_wait=2_000), "client")
    waiter = gevent.spawn(partial(get, session))
    gevent.sleep(0)
    runtime.advance(1_999)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    gevent.sleep(0)
    assert waiter.ready() and not waiter.value


def test_once_the_client_is_gone_no_wait_starts_and_a_cancelled_wait_takes_nothing(
        server: ServerState) -> None:
    session, producer = Session(server, "client"), Session(server, "producer")
    waiter = gevent.spawn(partial(session.get, "q", timeout_ms=10_000))
    gevent.sleep(0)
    assert session.waiting
    session.client_gone()
    waiter.kill(ClientGone)  # what the connection does while `waiting` says it may
    assert isinstance(waiter.exception, ClientGone) and not session.waiting
    with pytest.raises(ClientGone):
        session.get("q", timeout_ms=10_000)
    assert server.collection.queue("q").waiters == 0
    producer.put("q", [b"a"])
    assert _drain(server, "q") == [b"a"]  # the dead connection took nothing


def _yields_after_the_wait(gone: set[Session] | None = None) -> Watch:
    """A watch that lets the others run once the wait is over, as a connection's does when it
    stops watching its client; a session in `gone` sees its client hang up just then."""
    def watch(session: Session, wait: Callable[[], QItem | None]) -> QItem | None:
        found = wait()
        if gone is not None and session in gone:
            session.client_gone()
        gevent.sleep(0)
        return found
    return watch


@pytest.mark.parametrize("get", [
    lambda session: session.get("q", timeout_ms=10_000),
    lambda session: session.get("q", timeout_ms=10_000, open=True),
    lambda session: [data for data, _ in session.get_items("q", 1, 10_000).pairs()],
])
def test_waiters_are_served_first_come_first_one_item_each(server: ServerState,
                                                           get: Callable[[Session], list[bytes]]) -> None:
    producer = Session(server, "producer")
    sessions = [Session(server, f"client {n}", watch=_yields_after_the_wait()) for n in range(5)]
    waiters = []
    for session in sessions:
        waiters.append(gevent.spawn(partial(get, session)))
        gevent.sleep(0)
    for n in range(5):
        producer.put("q", [b"%d" % n])  # one at a time, the queue empty before each
        gevent.sleep(0)
        gevent.sleep(0)
    gevent.joinall(waiters, timeout=1)
    assert [w.value for w in waiters] == [[b"0"], [b"1"], [b"2"], [b"3"], [b"4"]]


def test_waiting_peeks_see_the_item_that_comes_and_pass_it_on_to_the_next_waiter(server: ServerState) -> None:
    producer = Session(server, "producer")
    kinds = ["peek", "peek", "get", "peek", "get"]
    waiters = []
    for n, kind in enumerate(kinds):
        session = Session(server, f"client {n}", watch=_yields_after_the_wait())
        waiters.append(gevent.spawn(partial(session.get, "q", timeout_ms=10_000, peek=kind == "peek")))
        gevent.sleep(0)
    for n in range(2):
        producer.put("q", [b"%d" % n])
        for _ in range(4):
            gevent.sleep(0)
    gevent.joinall(waiters, timeout=1)
    assert [w.value for w in waiters] == [[b"0"], [b"0"], [b"0"], [b"1"], [b"1"]]
    assert server.collection.queue("q").waiters == 0 and _drain(server, "q") == []


def test_monitors_of_one_queue_share_its_items_in_turn(server: ServerState) -> None:
    producer = Session(server, "producer")
    sessions = [Session(server, f"monitor {n}", watch=_yields_after_the_wait()) for n in range(2)]
    monitors = []
    for session in sessions:
        monitors.append(gevent.spawn(lambda s=session: list(s.monitor("q", 10_000, 3))))
        gevent.sleep(0)
    for n in range(6):
        producer.put("q", [b"%d" % n])
        gevent.sleep(0)
        gevent.sleep(0)
    gevent.joinall(monitors, timeout=1)
    assert [m.value for m in monitors] == [[b"0", b"2", b"4"], [b"1", b"3", b"5"]]


def test_a_waiter_whose_client_hangs_up_as_its_item_comes_hands_the_item_to_the_next(
        server: ServerState) -> None:
    producer = Session(server, "producer")
    first, second = Session(server, "first"), Session(server, "second")
    first.watch, second.watch = _yields_after_the_wait({first}), _yields_after_the_wait()
    waiters = [gevent.spawn(partial(s.get, "q", timeout_ms=10_000, open=True)) for s in (first, second)]
    gevent.sleep(0)
    producer.put("q", [b"a"])
    gevent.joinall(waiters, timeout=1)
    assert isinstance(waiters[0].exception, ClientGone) and waiters[1].value == [b"a"]


def test_a_waiter_whose_client_hangs_up_while_it_looks_hands_its_wake_up_to_the_next(
        server: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A woken waiter's look waits behind a large write of the queue's journal; its client gone
    there, the item it was woken for goes to the next waiter, not to its deadline."""
    writes = HeldWrites(monkeypatch)
    producer = Session(server, "producer")
    sessions = [Session(server, f"client {n}") for n in range(3)]
    waiters = []
    for session in sessions:
        waiters.append(gevent.spawn(partial(session.get, "q", timeout_ms=10_000)))
        gevent.sleep(0)

    def produce() -> None:
        producer.put("q", [b"a"])  # wakes the first waiter
        producer.put("q", [LARGE])  # written off the loop: the first one's look waits at the gate

    put = gevent.spawn(produce)
    writes.wait_started(put)
    assert sessions[0].waiting  # so its connection, seeing the hang-up, throws it into the wait
    sessions[0].client_gone()
    waiters[0].kill(ClientGone, timeout=1)
    writes.release.set()
    gevent.joinall([put, *waiters[1:]], timeout=5)
    assert isinstance(waiters[0].exception, ClientGone)
    assert [w.value for w in waiters[1:]] == [[b"a"], [LARGE]]


def test_a_get_waiting_when_the_server_turns_quiescent_is_refused_when_an_item_comes(
        server: ServerState) -> None:
    admin = Session(server, "admin")
    waiters = [gevent.spawn(partial(Session(server, f"client {n}").get, "q", timeout_ms=10_000)) for n in range(2)]
    gevent.sleep(0)
    admin.set_status("quiescent")
    server.collection.put("q", [b"a"])  # an abort's return, say: the status refuses no return
    gevent.joinall(waiters, timeout=1)
    assert all(isinstance(w.exception, RefusedByStatus) for w in waiters)  # the turn passed on, refused too
    assert "get refused: server is Quiescent" in str(waiters[0].exception)
    assert _drain(server, "q") == [b"a"]


# ---------------------------------------------------------------------------------------------
# Writes, expiry, stats


def test_expiry_is_counted_from_the_servers_clock(server: ServerState, runtime: ManualRuntime) -> None:
    session = Session(server, "client")
    assert session.expiry_after(0) == 0  # never expires
    assert session.expiry_after(1_000) == runtime.clock.now_ms() + 1_000
    session.put("q", [b"late"], session.expiry_after(-5))  # already expired: accepted, never handed out
    session.put("q", [b"soon"], session.expiry_after(1_000))
    session.put("q", [b"never"])
    runtime.advance(1_000)
    assert session.get("q") == [b"never"]


def test_flushing_a_missing_queue_does_not_create_it(server: ServerState) -> None:
    session = Session(server, "client")
    session.flush("missing")
    assert session.flush_expired("missing") == 0
    assert "missing" not in server.collection.queue_names()


def test_stats_count_commands_hits_and_misses(server: ServerState, runtime: ManualRuntime) -> None:
    session = Session(server, "client")
    Session(server, "other").close()
    assert session.put("q", [b"a", b"b", b"c"]) == 3
    assert session.get("q") == [b"a"]
    assert session.get("empty") == []
    assert session.get("q", peek=True) == [b"b"]
    assert session.peek("q") is not None
    assert session.get_items("q", 5).pairs() == [(b"b", 0), (b"c", 0)]
    assert session.get_items("q", 5).pairs() == []
    runtime.advance(5_000)
    stats = server.global_stats()
    assert {key: stats[key] for key in ("curr_connections", "total_connections", "cmd_set", "cmd_get",
                                        "cmd_peek", "get_hits", "get_misses", "uptime")} == {
        "curr_connections": 1, "total_connections": 2, "cmd_set": 3, "cmd_get": 4, "cmd_peek": 2,
        "get_hits": 5, "get_misses": 3, "uptime": 5}
    assert stats["time"] == runtime.clock.now_ms() // 1000


def test_uptime_counts_the_time_run_and_time_follows_the_wall_clock_through_its_steps(
        server: ServerState, runtime: ManualRuntime) -> None:
    """A step of the wall clock (NTP, a VM resumed) moves `time`, never `uptime`: it neither goes
    negative after a step back nor counts an hour that never passed after a step forward."""
    runtime.advance(5_000)
    runtime.clock.step(-3_600_000)
    stats = server.global_stats()
    assert stats["uptime"] == 5 and stats["time"] == runtime.clock.now_ms() // 1000
    runtime.clock.step(7_200_000)
    runtime.advance(2_000)
    stats = server.global_stats()
    assert stats["uptime"] == 7 and stats["time"] == runtime.clock.now_ms() // 1000


def test_the_server_takes_its_collections_runtime(tmp_path: Path, runtime: ManualRuntime) -> None:
    config = ServerConfig(queue_path=str(tmp_path))
    collection = QueueCollection(str(tmp_path), runtime=runtime)
    server = ServerState(config, collection)
    assert server.runtime is runtime
    waiter = gevent.spawn(partial(server.shutdown_requested.wait, 1.0))
    gevent.sleep(0)
    runtime.advance(1_000)  # the shutdown event is the runtime's: its wait ends on the manual clock
    gevent.sleep(0)
    assert waiter.ready() and waiter.value is False
    with pytest.raises(ValueError, match="runtime must be its collection's"):
        ServerState(config, collection, ManualRuntime())
    server.close()


def test_a_pipelined_run_counts_and_answers_as_its_commands_one_by_one(server: ServerState) -> None:
    session = Session(server, "pipelined")
    assert session.put("q", [b"a", b"b", b"c"]) == 3
    assert session.get("q", 5) == [b"a", b"b", b"c"]
    stats = server.stats
    assert (stats.cmd_set, stats.cmd_get, stats.get_hits, stats.get_misses) == (3, 5, 3, 2)
    # Beside an open read on the queue the run's first get answers OpenReadConflict, counting nothing.
    session.put("q", [b"d"])
    assert session.get("q", open=True) == [b"d"]
    with pytest.raises(OpenReadConflict):
        session.get("q", 2)
    assert (stats.cmd_get, stats.get_hits) == (6, 4)  # only the /open get counted
    # A refusing status refuses the run as it would each command, counting nothing.
    server.status.set(Status.READ_ONLY)
    with pytest.raises(RefusedByStatus):
        session.put("q", [b"e"])
    assert stats.cmd_set == 4


def test_a_put_counts_its_items_as_kestrel_does_one_by_one(make_server: MakeServer) -> None:
    server = make_server(queues=QueueConfigs({}, {"small": {"max_items": 2}}))
    session = Session(server, "client")
    assert session.put("small", [b"a", b"b", b"c", b"d"]) == 2
    assert server.stats.cmd_set == 3  # those accepted, and the one refused: the put stopped there
    assert session.put("small", [b"e"]) == 0 and server.stats.cmd_set == 4


def test_under_flow_control_a_put_is_held_then_refused_as_one_item(make_server: MakeServer,
                                                                    runtime: ManualRuntime) -> None:
    server = make_server(max_memory_total=64 * 1024 * 1024)
    governor = server.collection.governor
    assert governor is not None
    governor._start_flow(governor.budget + 1, runtime.clock.now_ms())
    session = Session(server, "pipelined")
    put = gevent.spawn(partial(session.put, "q", [b"a", b"b"]))
    gevent.sleep(0)
    assert not put.ready()  # held
    runtime.advance(governor.hold_ms)
    gevent.sleep(0)
    assert isinstance(put.exception, MemoryBudgetExceeded)
    # The item it answers counts, as a put of that item alone would; the protocol puts the rest again.
    assert server.stats.cmd_set == 1 and governor.refused_puts == 1 and _drain(server, "q") == []
    governor.flow_control = False
    assert session.put("q", [b"a", b"b"]) == 2


# ---------------------------------------------------------------------------------------------
# Requests answered in the hub's callback


def test_only_a_put_or_get_that_cannot_yield_is_answered_at_once(make_server: MakeServer,
                                                                  runtime: ManualRuntime) -> None:
    server = make_server(
        max_memory_total=64 * 1024 * 1024, aliases={"both": ["plain"]},
        queues=QueueConfigs({}, {"durable": {"sync_journal": "always"}, "moving": {"expire_to_queue": "plain"},
                                 "poisoned": {"error_queue": "plain", "max_errors": 1},
                                 "dropping": {"max_errors": 2}, "behind": {"max_memory_size": 16}}))
    session = Session(server, "client")
    assert not session.answers_at_once("plain")  # not held yet: its creation may wait for an fsync
    for name in ("plain", "durable", "moving", "poisoned", "dropping", "fan", "fan+out"):
        session.put(name, [b"x"])
    assert session.answers_at_once("dropping", 1)  # a put, a get, a confirm, an abort (a drop logged after)
    assert session.answers_at_once("plain") and session.answers_at_once("fan+out")
    assert session.answers_at_once("plain", GET_SLICE) and not session.answers_at_once("plain", GET_SLICE + 1)
    assert session.answers_at_once("plain", 1, timeout_ms=1000)  # the item is there: no wait
    assert not session.answers_at_once("plain", 2, timeout_ms=1000)  # it would wait for the second
    assert not session.answers_at_once("durable")  # its changes wait for an fsync
    assert not session.answers_at_once("moving") and not session.answers_at_once("poisoned")
    assert not session.answers_at_once("both") and not session.answers_at_once("fan")  # alias, fanout parent
    session.put("behind", [b"x" * 64] * 4)
    assert server.collection.queue("behind").in_read_behind
    # (Kestrel 2: a put's undo, should its write fail, waits for the journal's packs and refills)
    assert not session.answers_at_once("behind")
    assert not session.answers_at_once("behind", 1)  # a get may read a large record back off the loop
    governor = server.collection.governor
    assert governor is not None
    governor._start_flow(governor.budget + 1, runtime.clock.now_ms())
    assert not session.answers_at_once("plain")  # a put is held under flow control


def test_a_queue_an_alias_hides_shows_nothing_to_a_look(server: ServerState) -> None:
    """A get of an alias's name finds nothing: `peek_items` showed the items of the queue the alias
    hides, and Thrift's `peek` its figures beside no head item."""
    session = Session(server, "client")
    session.put("o", [b"secret"])
    server.collection.reload(QueueConfigs(), {"o": ["elsewhere"]})
    assert session.get("o") == [] and session.peek_items("o", 0, 5).shown == []
    info = session.queue_info("o")
    assert info["head_item"] is None and info["items"] == 0 and info["bytes"] == 0
    misses = server.stats.get_misses
    assert session.get_items("o", 1).items == [] and server.stats.get_misses == misses + 1  # empty, as memcache's
    server.collection.reload(QueueConfigs(), {})
    assert len(session.peek_items("o", 0, 5).shown) == 1 and session.queue_info("o")["items"] == 1
