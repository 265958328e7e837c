"""The guide's "Server stats" for memcache STATS and DUMP_STATS, JSON and text (Prometheus: metrics.py).

`/stats.json` is `server_document` with every queue's figures; the admin page
(src/kestrel/service/dashboard/) reads the same two sources, so the page and the JSON never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kestrel.service.session.server_state import ServerState
from kestrel.storage.runtime import PACE, paced

# Queues whose figures (about 20 lines each) are written between two pauses: a few milliseconds.
QUEUES_A_SLICE = PACE // 4

# A page of every queue's figures as the pieces it was written in, a slice of queues each: sent one
# after another and never joined. Joined, 10,000 queues' figures were a fresh block of up to 11 MB
# made in one step, whose page faults alone held the loop for 5 ms (the longest wait of a client
# while they were read, 15 ms).
Pieces = list[bytes]

T = TypeVar("T")


def in_slices(server: ServerState, entries: Sequence[T]) -> Iterator[Sequence[T]]:
    """`entries` QUEUES_A_SLICE at a time, the other clients served between two slices (10,000
    queues' figures are about 220,000 lines, hundreds of milliseconds of work that would otherwise
    hold every client)."""
    for start in paced(range(0, len(entries), QUEUES_A_SLICE), server.runtime, every=1):
        yield entries[start:start + QUEUES_A_SLICE]


def written_paced(server: ServerState, entries: Sequence[T], text: Callable[[T], str], head: str = "",
                  tail: str = "") -> Pieces:
    """`head`, `text(entry)` of every entry, then `tail`: each slice of entries encoded on its own
    (`in_slices`), a piece of the page. A queue name that is not UTF-8 on disk (a Kestrel 2
    journal's: lone surrogates) is written as `/stats.json` shows it, `\udce9`."""
    pieces = [head.encode(errors="backslashreplace")]
    pieces.extend("".join([text(entry) for entry in part]).encode(errors="backslashreplace")
                  for part in in_slices(server, entries))
    pieces.append(tail.encode())
    return pieces


def _flat_stats(server: ServerState, line: Callable[[str, Any], str], tail: str = "") -> Pieces:
    """Global figures, `refused_queue_<name> 1` for each queue refused at start-up (its journal is
    damaged or cannot be written), then `queue_<name>_<stat>` for every queue (memcache STATS
    order), each figure written by `line(name, value)`, then `tail`."""
    head = [line(key, value) for key, value in server.global_stats().items()]
    head.extend(line(f"refused_queue_{name}", 1) for name in server.collection.refused_queues())

    def queue_lines(entry: tuple[str, dict[str, int]]) -> str:
        name, stats = entry
        return "".join([line(f"queue_{name}_{key}", value) for key, value in stats.items()])

    return written_paced(server, list(server.kestrel_queue_stats().items()), queue_lines, "".join(head), tail)


def memcache_stats(server: ServerState) -> Pieces:
    return _flat_stats(server, lambda key, value: f"STAT {key} {value}\r\n", "END\r\n")


def stats_text(server: ServerState) -> Pieces:
    return _flat_stats(server, lambda key, value: f"{key}: {value}\n")


def queue_blocks(server: ServerState, per_queue: dict[str, dict[str, Any]]) -> Pieces:
    """`queue '<name>' {` blocks of `  key=value` lines, then END (Kestrel's DUMP_STATS layout).

    Every line ends in CRLF, as Kestrel's do: clients read the reply line by line up to `END`.
    """
    def block(entry: tuple[str, dict[str, Any]]) -> str:
        name, values = entry
        body = "".join([f"  {key}={value}\r\n" for key, value in values.items()])
        return f"queue '{name}' {{\r\n{body}}}\r\n"

    return written_paced(server, list(per_queue.items()), block, tail="END\r\n")


def dump_stats(server: ServerState, names: Sequence[str] | None = None) -> Pieces:
    """Kestrel's DUMP_STATS: every queue's block, or those of `names` (a name that is no queue's or
    alias's gets an empty block)."""
    return queue_blocks(server, server.kestrel_queue_stats(names))


def dump_config(server: ServerState) -> Pieces:
    """Every queue's settings as `queue_blocks`, read a slice of queues at a time."""
    coll = server.collection
    names = paced(coll.queue_names(), server.runtime)
    return queue_blocks(server, {name: q.settings() for name in names if (q := coll.get(name))})


def server_document(server: ServerState) -> dict[str, Any]:
    """`stats_document` but the queues' figures (what the admin page reads beside each queue's
    `stats()`, a slice of queues at a time): the guide's server figures; the status (a stricter one
    applies its refusals after `status_change_grace_period`: `enforced_status`); the ZooKeeper
    membership (None without `zookeeper`); the queues refused at start-up with the damage found
    (`refused_queues`) and the remedy (`refused_remedies`), as every request to them says; open
    connections by protocol; aliases; the commit log (None when off)."""
    coll = server.collection
    return {
        "server": server.global_stats(),
        "status": server.status.current.label,
        "enforced_status": server.status.enforced.label,
        "server_sets": server.server_sets(),
        "refused_queues": coll.refused_queues(),
        "refused_remedies": {name: error.remedy() for name, error in sorted(coll.refused.items())},
        "connections": {protocol: count for protocol, count in sorted(server.stats.connections.items())
                        if protocol},
        "aliases": {alias: list(queues) for alias, queues in sorted(coll.aliases.items())},
        "commit_log": None if coll.commit_log is None else coll.commit_log.stats(),
    }


def stats_document(server: ServerState) -> dict[str, Any]:
    """Every figure of the admin port under Kestrel's names, read once: the one source of `/stats.json`,
    `/metrics` and the admin page (src/kestrel/service/dashboard/)."""
    return {**server_document(server), "queues": server.queue_stats()}


def stats_json(server: ServerState) -> Pieces:
    """`stats_document` as JSON with sorted keys: the queues' figures encoded a slice at a time with
    the other clients served in between (10,000 queues' JSON is tens of milliseconds of work), a
    piece each, the figures before them in the first and those after in a piece of their own."""
    document = server_document(server)
    document["queues"] = server.queue_stats()
    pieces: Pieces = []
    text: list[str] = []  # what goes before the next piece
    for key, value in sorted(document.items()):
        text.append(", " if text or pieces else "{")
        text.append(f"{json.dumps(key)}: ")
        if key != "queues":
            text.append(json.dumps(value, sort_keys=True))
            continue
        text.append("{")
        for n, part in enumerate(in_slices(server, list(value))):  # (the names come sorted)
            if n:
                text.append(", ")
            text.append(json.dumps({name: value[name] for name in part}, sort_keys=True)[1:-1])
            pieces.append("".join(text).encode())
            text = []
        text.append("}")
    text.append("}")
    pieces.append("".join(text).encode())
    return pieces


