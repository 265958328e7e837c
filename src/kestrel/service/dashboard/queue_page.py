"""What the page of one queue shows: its figures (the same `stats()` as `/stats.json`), state and
rates from the shared snapshot, its history while the page is open, its settings, its files with
what its manifest records, the readers of a Kestrel 3 queue, its error queue, fanout and aliases;
or, for a queue refused at start-up, the damage and the remedy as its refusal says them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kestrel.service.dashboard.figures import REFUSED, Figures, queue_state
from kestrel.service.session.server_state import ServerState
from kestrel.storage.config import setting_unit


def queue_document(server: ServerState, figures: Figures, name: str) -> dict[str, Any] | None:
    """The page's figures for queue `name`; None when there is no such queue, nor a refused one."""
    coll = server.collection
    parent, plus, _ = name.partition("+")
    refused = coll.refused.get(name) or (coll.refused.get(parent) if plus else None)
    q = coll.get(name)
    if q is None and refused is None:
        return None
    snapshot = figures.snapshot()
    doc: dict[str, Any] = {
        "name": name,
        "time_ms": snapshot.time_ms,
        "version": server.version,
        "status": server.status.current.label,
        "enforced_status": server.status.enforced.label,
        "fanout": {"parent": parent if plus else None, "children": coll.fanouts.children(name)},
        "aliases": sorted(alias for alias, queues in coll.aliases.items() if name in queues),
    }
    if q is None:
        assert refused is not None
        return {**doc, "state": REFUSED, "refused": {"damage": str(refused), "remedy": refused.remedy(),
                                                     "file": refused.path, "offset": refused.offset}}
    stats = q.stats()
    rates = snapshot.rates.get(name)
    governor = coll.governor
    config = q.config
    error_queue = None
    if config.error_queue is not None:
        target = coll.get(config.error_queue)
        error_queue = {"name": config.error_queue, "max_errors": config.max_errors,
                       "items": target.length if target is not None else 0,
                       "bytes": target.bytes if target is not None else 0}
    return {
        **doc,
        "state": queue_state(stats, config, governor is not None and governor.flow_control),
        "refused": None,
        "stats": stats,
        "rates": None if rates is None else {"in": rates[0], "out": rates[1]},
        "history": figures.watch(name).columns(snapshot),
        "settings": [{"name": key, "value": value, "unit": setting_unit(key)}
                     for key, value in config.values().items()],
        "files": [asdict(f) for f in q.journal_files()],
        "readers": [asdict(p) for p in q.reader_positions()],
        "error_queue": error_queue,
        "poison_dropped": config.max_errors > 0 and config.error_queue is None,
    }
