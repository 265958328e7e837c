"""The figures of every queue (`/stats.json`, `/metrics`, memcache `stats` and `dump_stats`) with
many queues: the same document as one encoding of it, read and encoded a slice of queues at a
time with the other clients served in between (src/kestrel/service/stats_render.py,
src/kestrel/storage/runtime.py `paced`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gevent
import pytest
import structlog

from kestrel.service.config import ServerConfig
from kestrel.service.session.server_state import ServerState
from kestrel.service.stats_render import memcache_stats, stats_document, stats_json
from kestrel.storage.runtime import PACE, ManualRuntime

QUEUES = 2 * PACE + 100  # three slices


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    state = ServerState(ServerConfig(queue_path=str(tmp_path_factory.mktemp("queues"))), runtime=ManualRuntime())
    state.collection.load()
    for i in range(QUEUES):
        state.collection.put(f"q{i:05}", [b"x" * (i % 7)])
    yield state
    state.close()
    structlog.contextvars.clear_contextvars()


def turns_while(work: object) -> tuple[object, int]:
    """`work()`'s result, and how many turns another greenlet had while it ran."""
    turns = 0

    def other_client() -> None:
        nonlocal turns
        while True:
            turns += 1
            gevent.sleep(0)

    other = gevent.spawn(other_client)
    gevent.sleep(0)
    before = turns
    try:
        result = work()  # type: ignore[operator]
    finally:
        other.kill()
    return result, turns - before


def test_stats_json_is_the_document_encoded_with_sorted_keys(server: ServerState) -> None:
    assert stats_json(server) == json.dumps(stats_document(server), sort_keys=True).encode()
    queues = json.loads(stats_json(server))["queues"]
    assert len(queues) == QUEUES and queues["q00006"]["bytes"] == 6


def test_stats_json_of_few_queues_is_the_document_too(tmp_path: Path) -> None:
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=ManualRuntime())
    state.collection.load()
    try:
        assert json.loads(stats_json(state))["queues"] == {}
        state.collection.put("jobs", [b"abc"])
        assert stats_json(state) == json.dumps(stats_document(state), sort_keys=True).encode()
    finally:
        state.close()


@pytest.mark.parametrize("render", [stats_json, memcache_stats])
def test_the_figures_of_every_queue_let_the_other_clients_in_between_slices(server: ServerState,
                                                                             render: object) -> None:
    body, turns = turns_while(lambda: render(server))  # type: ignore[operator]
    assert isinstance(body, bytes) and b"q01099" in body
    # Each walk over the queues pauses after each slice but the last: the queues' figures, their
    # sums (items, bytes, memory) and, for the JSON, its encoding.
    assert turns >= 2 * (QUEUES // PACE)
