"""Aliases: a name whose writes go to several queues (Kestrel's guide: aliases). An alias holds no
items: a put to it adds each item to every destination queue, and a read of it gives nothing.

A put through an alias goes item by item, as Kestrel's does: each item goes to every destination,
and it counts only if every one of them accepted it; the put stops after the first item that does
not count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

Put = Callable[[str, list[bytes], int], int]  # the collection's put: (queue, items, expiry) -> accepted


class Aliases(dict[str, list[str]]):
    """Each alias's destination queues, by alias name (a dict, so that a request's look-up costs no
    Python call)."""

    @classmethod
    def of(cls, aliases: Mapping[str, list[str]] | None) -> Aliases:
        return cls({name: list(destinations) for name, destinations in (aliases or {}).items()})

    def put(self, name: str, items: list[bytes], expiry_ms: int, put: Put) -> int:
        """Put `items` through alias `name` with the collection's `put`; how many counted."""
        for n, data in enumerate(items):
            took = [put(destination, [data], expiry_ms) for destination in self[name]]  # each, as Kestrel
            if not all(took):
                return n
        return len(items)


class AliasPuts(dict[str, tuple[int, int]]):
    """Items and bytes offered to each alias since the server started, by alias name (Kestrel's
    `put_items` and `put_bytes` of an alias: every item offered, taken or not)."""

    def count(self, name: str, offered: list[bytes]) -> None:
        items, size = self.get(name, (0, 0))
        self[name] = (items + len(offered), size + sum(map(len, offered)))
