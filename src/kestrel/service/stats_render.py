"""The guide's "Server stats" for memcache STATS and DUMP_STATS, JSON and text (Prometheus: metrics.py).

`/stats.json` is `server_document` with every queue's figures; the admin page
(src/kestrel/service/dashboard/) reads the same two sources, so the page and the JSON never disagree.
"""

from __future__ import annotations

import json
from typing import Any

from kestrel.service.session.server_state import ServerState


def flat_stats(server: ServerState) -> list[tuple[str, Any]]:
    """Global figures, `refused_queue_<name> 1` for each queue refused at start-up (its journal is
    damaged or cannot be written), then `queue_<name>_<stat>` for every queue (memcache STATS order)."""
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


def stats_json(server: ServerState) -> bytes:
    return json.dumps(stats_document(server), sort_keys=True).encode()


def stats_text(server: ServerState) -> bytes:
    return "".join(f"{key}: {value}\n" for key, value in flat_stats(server)).encode()
