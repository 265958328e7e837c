"""What every connection shares: the queues, the status, the counters and the open reads by id."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kestrel import SERVER_VERSION
from kestrel.service.config import ServerConfig, default_memory_total
from kestrel.service.gc_pauses import GC_PAUSES
from kestrel.service.session.open_reads import ReadsById
from kestrel.service.session.read_ids import ReadIds
from kestrel.service.session.stats import ServerStats
from kestrel.service.session.status import StatusKeeper
from kestrel.storage import QueueCollection
from kestrel.storage.errors import ConfigError
from kestrel.storage.runtime import Runtime, paced

log = structlog.get_logger("kestrel.server")

# What a reload applies (as Kestrel's does): queue settings and aliases. `source` and `overridden`
# describe where the settings came from.
RELOADED = frozenset({"queues", "aliases", "source", "overridden", "file_keys"})


class ServerState:
    """What the sessions share: the queues, the status, the counters and the open reads by id.

    Time, timers and events come from the storage's runtime (`runtime`, or `collection`'s when one is
    given; gevent unless told), so that one manual clock drives the queues and the sessions alike.
    """

    def __init__(self, config: ServerConfig, collection: QueueCollection | None = None,
                 runtime: Runtime | None = None) -> None:
        self.config = config
        if collection is None:
            collection = QueueCollection(config.queue_path, config.queues, config.aliases,
                                         salvage=config.salvage, max_queues=config.max_queues,
                                         runtime=runtime, max_memory_total=config.max_memory_total,
                                         commit_log=config.commit_log)
        elif runtime is not None and runtime is not collection.runtime:
            raise ValueError("the server's runtime must be its collection's")
        self.collection = collection
        self.runtime = collection.runtime
        self.status = StatusKeeper(config.resolved_status_file(), config.default_status,
                                   config.status_change_grace_period, self.runtime)
        self.stats = ServerStats(started=collection.clock.monotonic())
        self.version = SERVER_VERSION
        self.reads_by_id = ReadsById(collection, ReadIds(config.queue_path, collection.clock))
        self.shutdown_requested = self.runtime.event()
        self._reloads = 0  # reloads begun (`reload`: the last begun applies)
        # The latest reload that applied the file or failed: its number, who asked, its error.
        self._reload_end: tuple[int, str, Exception | None] = (0, "", None)
        self._reload_ended = self.runtime.event()  # set, and replaced, as each one applies or fails
        # The ZooKeeper server-set membership, when the server joins sets (set by the app).
        self.membership: Callable[[], dict[str, bool]] | None = None

    def server_sets(self) -> dict[str, bool] | None:
        """`connected` to ZooKeeper, and a member of the `read` and `write` sets; None without
        ZooKeeper."""
        return None if self.membership is None else self.membership()

    def global_stats(self) -> dict[str, Any]:
        """The guide's global figures, under its names."""
        coll = self.collection
        s = self.stats
        budget = self.config.max_memory_total or default_memory_total()
        return {
            "uptime": int(coll.clock.monotonic() - s.started),
            "time": coll.clock.now_ms() // 1000,
            "version": self.version,
            "curr_items": coll.current_items(),
            "total_items": coll.total_items_added,
            "bytes": coll.current_bytes(),
            # What the queues may hold in memory (their max_memory_size) over the server's budget,
            # or the default budget without one (Kestrel's: over the JVM's heap).
            "reserved_memory_ratio": f"{coll.reserved_memory() / budget:.3f}",
            "curr_connections": s.curr_connections,
            "total_connections": s.total_connections,
            "cmd_get": s.cmd_get,
            "cmd_set": s.cmd_set,
            "cmd_peek": s.cmd_peek,
            "get_hits": s.get_hits,
            "get_misses": s.get_misses,
            "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written,
            "queue_creates": coll.queue_creates,
            "queue_deletes": coll.queue_deletes,
            "queue_expires": coll.queue_expires,
            "refused_queues": len(coll.refused),
            **(coll.governor.stats() if coll.governor is not None else {}),
            **GC_PAUSES.stats(),
        }

    def queue_stats(self) -> dict[str, dict[str, int]]:
        """Every queue's `stats()`, by name, read a slice at a time with the other clients served in
        between (a queue deleted meanwhile is left out)."""
        out = {}
        get = self.collection.get
        for name in paced(self.collection.queue_names(), self.runtime):
            q = get(name)
            if q is not None:
                out[name] = q.stats()
        return out

    def kestrel_queue_stats(self, names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """Each queue's figures as Kestrel's `stats` and `dump_stats` give them (`QueueCollection.stats`):
        `queue_stats()` (or those of `names` only: none for a name that is neither a queue nor an
        alias), a fanout parent's with its `children`, and each alias's `put_items`, `put_bytes` and
        `children` (its destinations)."""
        coll = self.collection
        if names is None:
            out: dict[str, dict[str, Any]] = dict(self.queue_stats())
        else:
            out = {name: q.stats() if (q := coll.get(name)) else {} for name in names}
        for parent, children in coll.fanouts.items():
            if out.get(parent):
                out[parent]["children"] = ",".join(sorted(children))
        for alias, destinations in coll.aliases.items():
            if names is None or alias in out:
                items, size = coll.alias_puts.get(alias, (0, 0))
                out[alias] = {"put_items": items, "put_bytes": size, "children": ",".join(destinations)}
        return out

    def reload(self, by: str = "SIGHUP") -> None:
        """Re-read the config file: queue and alias settings only, as Kestrel does. Other settings the
        file changed keep their running value, and the log names them: a restart applies them.

        The file is read and checked off the loop (thousands of configured queues take a second,
        which would hold every client) and applied on it; of reloads under way together, the last
        begun applies the file as it then is, and each earlier one ends as it does (`_fold`). A
        failure is logged, whoever asked (`by`), and raised: nothing changed; so is a file that sets
        nothing where the running one set something (`check_reload`), and a server started without
        a file.
        """
        from kestrel.service.config import check_reload, load

        if self.config.source is None:  # answered "Reloaded config." though nothing was read
            e = ConfigError("reload", "no config file: the server was started without --config")
            log.error("reload failed; keeping the current settings", error=_said(e), requested_by=by)
            raise e
        self._reloads += 1
        ticket = self._reloads
        fresh: ServerConfig | Exception
        try:
            fresh = self.runtime.run_blocking(load, self.config.source)
        except Exception as e:
            fresh = e
        if ticket != self._reloads:
            self._fold(ticket, by)  # a reload begun since has read the file again, and applies it
            return
        try:
            if isinstance(fresh, Exception):
                raise fresh
            check_reload(self.config, fresh)
            self.collection.reload(fresh.queues, fresh.aliases)  # raises ConfigError: nothing changed
        except Exception as e:
            log.error("reload failed; keeping the current settings", error=_said(e), requested_by=by)
            self._end_reload(ticket, by, e)
            raise
        self._end_reload(ticket, by, None)
        self.config.queues, self.config.aliases = fresh.queues, fresh.aliases
        self.config.file_keys = fresh.file_keys
        ignored = [f.name for f in dataclasses.fields(fresh)
                   if f.name not in RELOADED and f.name not in self.config.overridden
                   and getattr(fresh, f.name) != getattr(self.config, f.name)]
        if ignored:
            log.warning("reload ignored changed settings that only a restart applies", keys=ignored,
                        config=self.config.source)

    def _end_reload(self, ticket: int, by: str, error: Exception | None) -> None:
        """Reload `ticket` applied the file (`error` None) or failed: the reloads it overtook end so."""
        self._reload_end = (ticket, by, error)
        ended, self._reload_ended = self._reload_ended, self.runtime.event()
        ended.set()

    def _fold(self, ticket: int, by: str) -> None:
        """End reload `ticket`, overtaken before it applied anything, as the first reload begun after
        it to apply the file or fail does (waited for; it read the file as it then was): one log line
        saying so, and that one's error raised. Overtaken, it returned in silence, and the memcache
        `reload` it served answered `Reloaded config.` though the reload that overtook it failed."""
        while True:
            ended = self._reload_ended  # first: an end between the look and the wait still wakes it
            later, later_by, error = self._reload_end
            if later > ticket:
                break
            ended.wait()
        if error is None:
            log.info("reload folded into a later one, which applied the file as it then was",
                     requested_by=by, later_requested_by=later_by)
            return
        log.error("reload folded into a later one, which failed; keeping the current settings",
                  error=_said(error), requested_by=by, later_requested_by=later_by)
        raise error

    def close(self) -> None:
        """Cancel the auto-abort timers, then close the queues. Reads still open stay open in their
        journals, so the next start hands their items out again, as a crash would."""
        self.reads_by_id.cancel_timers()
        self.collection.close()

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()


def _said(error: BaseException) -> str:
    """An error as a log line gives it: its message, or what it is when it has none (MemoryError())."""
    return str(error) or repr(error)
