"""The client's retries, counted and not timed: its puts counted and its pauses recorded (its
`sleep` returns at once), for the client's tests and the Spark writer's."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kestrel.client import cluster as cluster_module
from kestrel.client.server import Server


@dataclass
class Retries:
    puts: int = 0  # attempts, one a server tried
    pauses: list[float] = field(default_factory=list)  # seconds asked of `sleep`
    sizes: list[int] = field(default_factory=list)  # the items of each attempt

    def clear(self) -> None:
        self.puts = 0
        self.pauses.clear()
        self.sizes.clear()


@pytest.fixture(name="retries")
def recorded_retries(monkeypatch: pytest.MonkeyPatch) -> Iterator[Retries]:
    seen = Retries()
    real_put = Server.put_checked  # what a Cluster calls, a server at a time

    def counted(self: Server, queue: str, items: list[bytes], expiration_ms: int) -> int:
        seen.puts += 1
        seen.sizes.append(len(items))
        return real_put(self, queue, items, expiration_ms)

    monkeypatch.setattr(Server, "put_checked", counted)
    monkeypatch.setattr(cluster_module, "time", types.SimpleNamespace(monotonic=time.monotonic,
                                                                      sleep=seen.pauses.append))
    yield seen
