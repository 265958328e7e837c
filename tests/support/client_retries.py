"""The client's retries, counted and not timed: its puts counted and its pauses recorded (its
`sleep` returns at once), for the client's tests and the Spark writer's."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kestrel.client import cluster as cluster_module
from kestrel.client.server import Server


@dataclass
class Retries:
    puts: int = 0  # attempts, one a server tried
    pauses: list[float] = field(default_factory=list)  # seconds asked of `sleep`

    def clear(self) -> None:
        self.puts = 0
        self.pauses.clear()


@pytest.fixture(name="retries")
def recorded_retries(monkeypatch: pytest.MonkeyPatch) -> Iterator[Retries]:
    seen = Retries()
    real_put = Server.put

    def counted(self: Server, *args: Any, **kwargs: Any) -> int:
        seen.puts += 1
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(Server, "put", counted)
    monkeypatch.setattr(cluster_module, "time", types.SimpleNamespace(monotonic=time.monotonic,
                                                                      sleep=seen.pauses.append))
    yield seen
