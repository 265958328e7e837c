"""Server-wide counters, named as in the guide's "Server stats"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ServerStats:
    start_time: float = field(default_factory=time.time)
    curr_connections: int = 0
    total_connections: int = 0
    cmd_get: int = 0
    cmd_set: int = 0
    cmd_peek: int = 0
    get_hits: int = 0
    get_misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
