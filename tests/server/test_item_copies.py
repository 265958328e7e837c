"""A 1 KB or 64 KB item's bytes are copied once in user space on their way from the socket to the journal,
and once from the queue to the socket, on every protocol (the counting: bench/item_copies.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import item_copies
from kestrel.service import socket_io
from kestrel.service.session.server_state import ServerState

pytestmark = pytest.mark.skipif(socket_io.receive_in_place is None,
                                reason="built without a C compiler: receives go through the scratch buffer")


@pytest.mark.parametrize("size", item_copies.SIZES)
@pytest.mark.parametrize("protocol", sorted(item_copies.PROTOCOLS))
def test_a_1_kb_or_64_kb_item_is_copied_once_from_the_socket_to_the_journal_and_once_back(
        server_state: ServerState, protocol: str, size: int) -> None:
    """The peak's bound tells one copy from two at 64 KB; at 1 KB the other checks count."""
    copies = item_copies.count(server_state, protocol, size)
    # The request was received in place, parsed into one new item, which the journal was written from.
    assert copies.received_in_place, "the request went through the scratch buffer: a copy more"
    assert copies.put_peak <= copies.put_bound, f"{copies.put_peak:,} bytes held at once"
    assert copies.stored_intact
    assert copies.journal_from_item, "the journal was written from a copy"
    assert copies.record_intact
    # The get's request is small; its reply carries the one copy of the item.
    assert copies.reply_intact
    assert copies.get_peak <= copies.get_bound, f"{copies.get_peak:,} bytes held at once"
    assert (copies.socket_to_journal, copies.queue_to_socket) == (1, 1)


@pytest.mark.parametrize("inflated", ["once", "always"])
def test_a_block_held_beside_one_measurement_is_not_the_requests_but_one_in_each_is(
        server_state: ServerState, monkeypatch: pytest.MonkeyPatch, inflated: str) -> None:
    """tracemalloc counts every thread: a megabyte another thread holds during one put and get is left
    out by the least of the three, while a copy more, which every one of them holds, still counts."""
    measure, calls = item_copies.allocated, []

    def allocated(action: Callable[[], object]) -> int:
        calls.append(action)
        extra = 1 << 20 if inflated == "always" or len(calls) <= 2 else 0
        return measure(action) + extra

    monkeypatch.setattr(item_copies, "allocated", allocated)
    copies = item_copies.count(server_state, "thrift", 65536)
    assert len(calls) == 2 * item_copies.TRIES
    expected = (1, 1) if inflated == "once" else (2, 2)
    assert (copies.socket_to_journal, copies.queue_to_socket) == expected
