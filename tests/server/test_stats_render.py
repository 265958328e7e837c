"""The figures of every queue (`/stats.json`, `/stats.txt`, `/metrics`, memcache `stats`, `dump_stats` and `dump_config`) with
many queues: the same document as one encoding of it, read and encoded a slice of queues at a
time with the other clients served in between (src/kestrel/service/stats_render.py,
src/kestrel/storage/runtime.py `paced`)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import gevent
import pytest
import structlog
from gevent import socket as gsocket
from prometheus_client.parser import text_string_to_metric_families

from kestrel.service import metrics
from kestrel.service.config import ServerConfig
from kestrel.service.session.server_state import ServerState
from kestrel.service.stats_render import (
    QUEUES_A_SLICE,
    Pieces,
    dump_config,
    dump_stats,
    memcache_stats,
    stats_document,
    stats_json,
    stats_text,
)
from kestrel.storage import QueueConfigs
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.runtime import PACE, GeventRuntime, ManualRuntime

QUEUES = 4 * PACE + 100  # five slices


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    state = ServerState(ServerConfig(queue_path=str(tmp_path_factory.mktemp("queues"))), runtime=ManualRuntime())
    state.collection.load()
    for i in range(QUEUES):  # created empty: a queue holds no descriptor until its first change
        state.collection.queue(f"q{i:05}")
    state.collection.put("q00006", [b"x" * 6])
    yield state
    state.close()
    structlog.contextvars.clear_contextvars()


def rounds_while(work: Callable[[], bytes]) -> tuple[bytes, int]:
    """`work()`'s result, and how many request/reply rounds a client and a server on a socket pair,
    both greenlets, made while it ran: each step of a round waits for its socket, so a round only
    moves when the loop looks at the sockets."""
    here, there = gsocket.socketpair()
    rounds = 0

    def client() -> None:
        nonlocal rounds
        while True:
            here.sendall(b"?")
            here.recv(1)
            rounds += 1

    def server() -> None:
        while True:
            there.recv(1)
            there.sendall(b"!")

    both = [gevent.spawn(client), gevent.spawn(server)]
    gevent.sleep(0.01)
    before = rounds
    try:
        result = work()
        return result, rounds - before
    finally:
        gevent.killall(both)
        here.close()
        there.close()


def test_stats_json_is_the_document_encoded_with_sorted_keys(server: ServerState) -> None:
    assert b"".join(stats_json(server)) == json.dumps(stats_document(server), sort_keys=True).encode()
    queues = json.loads(b"".join(stats_json(server)))["queues"]
    assert len(queues) == QUEUES and queues["q00006"]["bytes"] == 6


def test_stats_json_is_a_piece_a_slice_of_queues_and_one_for_the_figures_after_them(server: ServerState) -> None:
    """Not a piece for each figure around them (an admin client's write each)."""
    pieces = stats_json(server)
    assert len(pieces) == -(-QUEUES // QUEUES_A_SLICE) + 1
    assert pieces[0].startswith(b'{"aliases": ') and pieces[-1].endswith(b'"status": "Up"}')


def test_stats_json_of_few_queues_is_the_document_too(tmp_path: Path) -> None:
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=ManualRuntime())
    state.collection.load()
    try:
        assert json.loads(b"".join(stats_json(state)))["queues"] == {}
        state.collection.put("jobs", [b"abc"])
        assert b"".join(stats_json(state)) == json.dumps(stats_document(state), sort_keys=True).encode()
    finally:
        state.close()


EVERY_QUEUE = [stats_json, memcache_stats, stats_text, dump_stats, dump_config, metrics.render_per_queue]


@pytest.mark.parametrize("render", EVERY_QUEUE)
def test_the_figures_of_every_queue_let_the_other_clients_in_between_slices(
        server: ServerState, render: Callable[[ServerState], Pieces]) -> None:
    body, rounds = rounds_while(lambda: b"".join(render(server)))
    assert b"q01099" in body
    # Each walk over the queues (their figures; their items, bytes and memory summed; the JSON's
    # encoding) pauses after each slice but the last, for a turn of the loop: a round is two.
    assert rounds >= 3


def cpu_between_pauses(server: ServerState, work: Callable[[], object]) -> list[float]:
    """The CPU time of this thread (which other processes on the machine do not stretch) between
    each two pauses of `work()`, with the garbage collector held off (its pauses are not the work's)."""
    pause = server.runtime.pause
    marks: list[float] = []

    def marked() -> None:
        marks.append(time.thread_time())
        pause()

    server.runtime.pause = marked  # type: ignore[method-assign]
    gc.disable()
    try:
        started = time.thread_time()
        work()
        return [b - a for a, b in pairwise([started, *marks, time.thread_time()])]
    finally:
        gc.enable()
        del server.runtime.pause


@pytest.mark.parametrize("render", EVERY_QUEUE)
def test_the_figures_of_every_queue_are_never_joined_into_one_block(
        server: ServerState, render: Callable[[ServerState], Pieces]) -> None:
    """Joined, 10,000 queues' figures were a fresh block of megabytes made in one step, its page
    faults alone 5 ms of the loop: the page is handed on as the pieces it was written in, a slice
    of queues (or, for /metrics/per-queue, a family of figures) each."""
    pieces = render(server)
    assert max(map(len, pieces)) < sum(map(len, pieces)) / 4  # five slices of queues


@pytest.mark.parametrize("render", EVERY_QUEUE)
def test_no_stretch_between_two_pauses_is_a_large_part_of_the_figures_of_every_queue(
        server: ServerState, render: Callable[[ServerState], Pieces]) -> None:
    """Reading each queue's figures pauses after each slice of queues, and writing them out must
    too: 2,100 queues' lines (about 46,000) written in one stretch after they were read were 54–96%
    of the work, and held every client for seconds at 10,000 queues. Each build's reading and
    writing run at their own speeds, so the measure is the longest stretch's share of the whole."""
    def share() -> float:
        stretches = cpu_between_pauses(server, lambda: render(server))
        return max(stretches) / sum(stretches)

    # The better of two runs, so that a stray stall of the machine is not taken for the code's.
    assert min(share() for _ in range(2)) < 0.25


def _server_wide(body: bytes) -> dict[str, float]:
    """The unlabelled samples of a `/metrics` page, by name."""
    return {sample.name: sample.value for family in text_string_to_metric_families(body.decode())
            for sample in family.samples if not sample.labels}


def test_metrics_sum_the_queues_figures_as_each_queue_shows_them(tmp_path: Path) -> None:
    config = ServerConfig(queue_path=str(tmp_path / "queues"), queues=QueueConfigs({}, {"big": {"max_memory_size": 1000}}))
    state = ServerState(config, runtime=ManualRuntime())
    state.collection.load()
    try:
        state.collection.put("jobs", [b"abc"] * 3)
        assert state.collection.remove("jobs", 2, transaction=True)  # two open reads
        state.collection.put("big", [b"x" * 100] * 30)  # past its memory: paged out
        state.collection.put("jobs+copy", [b"d"])
        queues = stats_document(state)["queues"]
        shown = _server_wide(metrics.render(state))
        assert shown["kestrel_queues"] == len(queues) == 3
        for key, figure in metrics.QUEUE_SUMS.items():
            assert shown[figure.name] == sum(q[key] for q in queues.values()), key
        assert shown["kestrel_open_reads"] == 2 and shown["kestrel_paged_out_bytes"] > 0
        assert shown["kestrel_journal_bytes"] > 0
    finally:
        state.close()


def _families(body: bytes) -> dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
    return {f.name: (f.type, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(body.decode())}


def _per_queue_by_prometheus_client(state: ServerState) -> bytes:
    """The reference: the same figures laid out by prometheus-client's own families and renderer."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

    class Reference:
        def collect(self) -> Iterator[Metric]:
            queues = stats_document(state)["queues"]
            for key, figure in metrics.QUEUE_FIGURES.items():
                if figure is None:
                    continue
                kind = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
                family = kind(figure.name.removesuffix("_total"), figure.help, labels=["queue"])
                for name, figures in queues.items():
                    # A lone surrogate can't be UTF-8: shown escaped, as /stats.json shows it.
                    label = name.encode("utf-8", "backslashreplace").decode()
                    family.add_metric([label], figures[key] * figure.scale)
                yield family
            refused = GaugeMetricFamily("kestrel_queue_refused", metrics.REFUSED_HELP, labels=["queue"])
            for name in state.collection.refused_queues():
                refused.add_metric([name], 1.0)
            yield refused

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Reference())
    return generate_latest(registry)


def test_each_queues_metrics_are_what_prometheus_client_would_write(tmp_path: Path) -> None:
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=ManualRuntime())
    state.collection.load()
    try:
        # Kestrel 2 names may hold what a label must escape, and a lone surrogate (a memcache key
        # that is not UTF-8), which used to fail the whole page.
        for name in ("jobs", 'say"hi', "back\\slash", "bytes\udcff", "jobs+copy"):
            state.collection.put(name, [b"abc"] * 3)
        assert state.collection.remove("jobs", 2, transaction=True)
        body = b"".join(metrics.render_per_queue(state))
        assert _families(body) == _families(_per_queue_by_prometheus_client(state))
        labels = {s.labels["queue"] for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        assert labels == {"jobs", 'say"hi', "back\\slash", "bytes\\udcff", "jobs+copy"}
    finally:
        state.close()


@pytest.mark.pure_build
def test_metrics_build_no_queues_figures_and_let_the_other_clients_in(
        server: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(q: PersistentQueue) -> dict[str, int]:
        raise AssertionError(f"/metrics built the figures of queue {q.name!r}")

    monkeypatch.setattr(PersistentQueue, "stats", refused)
    body, rounds = rounds_while(lambda: metrics.render(server))
    assert _server_wide(body)["kestrel_queues"] == QUEUES
    assert rounds >= 3  # the walks over the queues (items, bytes, the sums) pause after each slice


def test_metrics_list_the_process_descriptors_off_the_loops_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """process_open_fds lists /proc's entry of every descriptor, one per queue's open journal: tens
    of milliseconds with 10,000 queues, which the loop's thread would spend holding every client."""
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=GeventRuntime())
    state.collection.load()
    listdir = os.listdir
    listed_on: list[int] = []

    def recorded(path: str) -> list[str]:
        if str(path).endswith("/fd"):
            listed_on.append(threading.get_ident())
        return listdir(path)

    monkeypatch.setattr(os, "listdir", recorded)
    try:
        state.collection.put("jobs", [b"x"])
        assert b"process_open_fds" in metrics.render(state)
    finally:
        state.close()
    assert listed_on and threading.get_ident() not in listed_on
