"""The guide's "Server stats" for memcache STATS and DUMP_STATS, JSON and text (Prometheus: metrics.py).

`/stats.json` is `server_document` with every queue's figures; the admin page
(src/kestrel/service/dashboard/) reads the same two sources, so the page and the JSON never disagree.
"""

from __future__ import annotations

import json
from typing import Any

from kestrel.service import metrics
from kestrel.service.session.server_state import ServerState


def flat_stats(server: ServerState) -> list[tuple[str, Any]]:
    """Global figures, `refused_queue_<name> 1` for each queue refused at start-up (its journal is
    damaged), then `queue_<name>_<stat>` for every queue (memcache STATS order)."""
    out = list(server.global_stats().items())
    out.extend((f"refused_queue_{name}", 1) for name in server.collection.refused_queues())
    for name, stats in server.queue_stats().items():
        out.extend((f"queue_{name}_{key}", value) for key, value in stats.items())
    return out


def memcache_stats(server: ServerState) -> bytes:
    lines = [f"STAT {key} {value}\r\n" for key, value in flat_stats(server)]
    return ("".join(lines) + "END\r\n").encode()


def queue_blocks(per_queue: dict[str, dict[str, Any]]) -> bytes:
    """`queue '<name>' {` blocks of `  key=value` lines, then END (Kestrel's DUMP_STATS layout).

    Every line ends in CRLF, as Kestrel's do: clients read the reply line by line up to `END`.
    """
    parts = []
    for name, values in per_queue.items():
        body = "".join(f"  {key}={value}\r\n" for key, value in values.items())
        parts.append(f"queue '{name}' {{\r\n{body}}}\r\n")
    return ("".join(parts) + "END\r\n").encode()


def dump_stats(server: ServerState) -> bytes:
    return queue_blocks(server.queue_stats())


def server_document(server: ServerState) -> dict[str, Any]:
    """Everything of `/stats.json` but the queues' figures: the guide's server figures; the queues
    refused at start-up with the damage found (`refused_queues`) and the remedy
    (`refused_remedies`), as every request to them says; the status (`enforced` lags `current`
    through a grace period); open connections by protocol; the ZooKeeper server sets (null without
    them); aliases; the commit log (null when off); and the journals' writes, fsyncs and packs."""
    coll = server.collection
    return {
        "server": server.global_stats(),
        "refused_queues": coll.refused_queues(),
        "refused_remedies": {name: error.remedy() for name, error in sorted(coll.refused.items())},
        "status": {"current": server.status.current.label, "enforced": server.status.enforced.label},
        "connections": {protocol: count for protocol, count in sorted(server.stats.connections.items())
                        if protocol},
        "server_sets": None if server.membership is None else server.membership.figures(),
        "aliases": {alias: list(queues) for alias, queues in sorted(coll.aliases.items())},
        "commit_log": None if coll.commit_log is None else coll.commit_log.stats(),
        "journal_io": {event: {"count": count, "seconds": seconds}
                       for event, (count, seconds) in metrics.storage_totals().items()},
    }


def stats_json(server: ServerState) -> bytes:
    return json.dumps({**server_document(server), "queues": server.queue_stats()}, sort_keys=True).encode()


def stats_text(server: ServerState) -> bytes:
    return "".join(f"{key}: {value}\n" for key, value in flat_stats(server)).encode()
