"""Acknowledgements held for the disk: a client's replies wait for its changes, the change does not.

Under `sync_journal: always` a change is acknowledged only once it is on disk. A caller of the
library waits for that inside the change (`PersistentQueue.add` returns once it is durable). The
server answers many clients from one event loop, and a wait per change cost it a greenlet switch,
an event and two `epoll_ctl` calls of the connection's socket watcher. So a connection holds its
`Acknowledgements` in its greenlet (`hold`): a change made there under the commit log records which
turn of the log holds it (`Turn`, src/kestrel/storage/commit_log.py) and returns at once; the
connection keeps its replies until that turn is durable, and the log tells it when, for every
connection of the turn together, once its fsync round has run (src/kestrel/service/replies.py).

Turns are settled in the order they were written, so a reply held for a turn goes out only after
every earlier turn is settled too: a client's replies stay in order, and one that follows a held
one without a change of its own waits behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Final, Protocol

from mypy_extensions import trait


@trait
class Settled:
    """A turn of the commit log, as a holder sees it: numbered in the order turns are written, and
    settled once its changes are durable or their fallback has run (the holder's `failed` then
    says whether its journals failed). A trait (`commit_log.Turn` derives from it), so that the
    compiled build reads `settled` of each held reply's turn through the class's table, not by
    name."""

    seq: int
    settled: bool


class Syncable(Protocol):
    """A journal whose own fsync can stand in for the log's (`JournalWriter`)."""

    path: str

    def sync_to(self, position: int) -> None: ...


class Acknowledgements:
    """The changes of one client that the disk has still to take, and what to call when it has.

    `last` is the newest turn holding one of them (a reply built now waits for it); `failed` the
    error that makes the client's replies since then undeliverable: its connection is closed
    rather than answered. `settled` is called on the event loop (never inside a change) once for
    each turn of the client's that is settled, in order. The journals written since the client's
    turns were last all settled are kept, each with its end, for the fallback on a failed turn
    (`wrote`, `written`).
    """

    __slots__ = ("last", "_journal", "_end", "_more", "failed", "settled")

    def __init__(self, settled: Callable[[], None]) -> None:
        self.last: Settled | None = None
        # The first journal written and its end in fields of their own, any other (a client of
        # several queues at once) in a dict: a client writing one queue, the usual case, costs no
        # dict filled a change and emptied when its turns settle.
        self._journal: Syncable | None = None
        self._end = 0
        self._more: dict[Syncable, int] | None = None
        self.failed: OSError | None = None
        self.settled = settled

    def wrote(self, journal: Syncable, end: int) -> None:
        """A change of the client's, held for a turn not yet settled, was appended to `journal`,
        which ends at `end` now (an end only grows: the last is the most)."""
        first = self._journal
        if first is None or first is journal:
            self._journal = journal
            self._end = end
        elif self._more is None:
            self._more = {journal: end}
        else:
            self._more[journal] = end

    def all_settled(self) -> None:
        """Every turn holding a change of the client's is settled: none of its journals is needed."""
        self._journal = None
        self._more = None

    def written(self) -> list[tuple[Syncable, int]]:
        """Each journal written since the client's turns were last all settled, with its end."""
        if self._journal is None:
            return []
        return [(self._journal, self._end), *(self._more or {}).items()]

    @property
    def pending(self) -> bool:
        """Whether a reply built now must wait for the disk."""
        last = self.last
        return last is not None and not last.settled


_HOLDER: Final[ContextVar[Acknowledgements | None]] = ContextVar("kestrel_acknowledgements", default=None)
# Asked by every change under `always`, bound once (a C static in the compiled build, not a lookup
# of the module's global and of its method).
_holder: Final = _HOLDER.get


def hold(acknowledgements: Acknowledgements) -> Token[Acknowledgements | None]:
    """From now on, changes made in the calling greenlet (each has a context of its own) do not wait
    for the disk: `acknowledgements` is told when they are durable, until `release` with the token
    returned."""
    return _HOLDER.set(acknowledgements)


def release(token: Token[Acknowledgements | None]) -> None:
    """In the calling greenlet, which `hold` returned `token` to, changes wait for the disk again
    (or go to the holder before): a connection served in a greenlet that lives on after it leaves
    no holder behind, whose replies would never be read."""
    _HOLDER.reset(token)


def holder() -> Acknowledgements | None:
    """The calling greenlet's holder, if it holds its acknowledgements (`hold`)."""
    return _holder()
