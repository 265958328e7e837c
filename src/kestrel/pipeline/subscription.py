"""Which queues a read takes on each server: the `queue` option's names and patterns, and `reader`.

- A name is one queue (a read fails if no server holds it; a stream waits for it).
- An entry with `*`, `?` or `[...]` is a pattern (shell-style, as `fnmatch` reads it), matched
  against each server's `queue_names()` whenever the read plans, as Kafka's `subscribePattern`
  matches topics: a stream takes up a new queue at its next batch. A pattern matches the queues
  themselves, not their fanout children (`jobs+audit`), unless it has a `+` itself.
- With `reader`, each queue is read through its fanout child `<queue>+<reader>` (in Kestrel 3
  terms, the reader of that name), so that readers of other names each see every item, as
  Kafka's consumer groups do. A stream creates the children it reads (`Subscription.children`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

PATTERN_CHARACTERS = "*?["


def is_pattern(entry: str) -> bool:
    return any(c in entry for c in PATTERN_CHARACTERS)


@dataclass(frozen=True)
class Subscription:
    """The `queue` option's entries (names and patterns, as given) and the `reader`, if any."""

    entries: tuple[str, ...]
    reader: str | None = None

    @property
    def names(self) -> list[str]:
        return [e for e in self.entries if not is_pattern(e)]

    @property
    def patterns(self) -> list[str]:
        return [e for e in self.entries if is_pattern(e)]

    def target(self, queue: str) -> str:
        """The queue a read asks the server for: `queue`, or its child for the reader."""
        return f"{queue}+{self.reader}" if self.reader else queue

    def matched(self, held: Iterable[str]) -> list[str]:
        """The queues (not yet through the reader) of `held` that the entries name or match, in
        the order of the entries, each once."""
        held = sorted(held)
        out: list[str] = []
        for entry in self.entries:
            if is_pattern(entry):
                found = [q for q in held if fnmatchcase(q, entry) and ("+" in entry or "+" not in q)]
            else:
                found = [entry] if entry in held else []
            out.extend(q for q in found if q not in out)
        return out

    def queues(self, held: Iterable[str]) -> list[str]:
        """What to read on a server holding `held`: each queue named or matched there (with a
        reader, its child, where the server holds that)."""
        held = set(held)
        return [t for q in self.matched(held) if (t := self.target(q)) in held]

    def children(self, held: Iterable[str]) -> list[str]:
        """The reader's children a stream creates on a server holding `held`: one for each named
        queue (so that it keeps every item put from now on, the queue created as well if need be)
        and for each queue a pattern matches there; none without a reader."""
        if not self.reader:
            return []
        held = set(held)
        parents = list(dict.fromkeys(self.names + self.matched(held)))
        return [t for q in parents if (t := self.target(q)) not in held]

    def unmatched(self, held_by_server: Iterable[Iterable[str]]) -> list[str]:
        """Entries no server holds (names) or matches (patterns): a batch read refuses them."""
        every: set[str] = set()
        for held in held_by_server:
            every.update(held)
        return [e for e in self.entries if not Subscription((e,), self.reader).queues(every)]

    def key(self) -> str:
        """What the subscription is, whatever the spelling of the option: the entries in order of
        their text, and the reader."""
        return ",".join(sorted(set(self.entries))) + (f"+{self.reader}" if self.reader else "")
