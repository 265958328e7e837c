"""Server-wide counters, named as in the guide's "Server stats"."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerStats:
    # The server clock's monotonic seconds at start (a manual clock moves it in tests): uptime counts
    # the time run, whatever steps the wall clock takes meanwhile.
    started: float
    curr_connections: int = 0
    total_connections: int = 0
    cmd_get: int = 0
    cmd_set: int = 0
    cmd_peek: int = 0
    get_hits: int = 0
    get_misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # Open connections by protocol ("thrift", "memcache", "text"), summing to curr_connections.
    connections: dict[str, int] = field(default_factory=dict)
