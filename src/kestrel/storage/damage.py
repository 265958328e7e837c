"""Refusal and remedy, once for both journal formats: what is damaged, what `--salvage` keeps and
sets aside, and what a refusal says (docs/durability.md, "Damage").

A format finds damage (its manifest check, its record reader) and reports it as `Finding`s: which
file, what is wrong, where, and how many items the remedy would set aside. It supplies only how.
The policy is here:

- Without salvage the queue is refused and nothing moves; the refusal names the damage and what
  `--salvage` would set aside, file by file with item counts (`refusal`).
- With salvage only what does not verify goes, into `.kestrel/aside/` (renamed or cut, never
  deleted): a stray file alone; a changed file whole (no record of it can be told intact); a
  damaged record and the rest of its file; an unreadable manifest. A file cut short keeps its
  whole records, and a missing one has nothing to move. Every other file is kept and replayed
  (`carry_out`): the remedy keeps every item it can prove intact.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from kestrel.storage import layout
from kestrel.storage.errors import CorruptJournalError, JournalWriteError
from kestrel.storage.journal_file import cut_keeping_copy

log = structlog.get_logger("kestrel.damage")


class Remedy(enum.Enum):
    SET_ASIDE = "set aside"  # the whole file renamed into `.kestrel/aside/`
    CUT = "cut"  # kept before `offset`, the rest copied aside
    NONE = "nothing to move"  # a missing file; a file cut short, whose whole records are kept


class RecordFile(Protocol):
    """A reader of one journal file's records, either format's."""

    def __iter__(self) -> Iterator[Any]: ...

    def close(self) -> None: ...


def items_before_damage(open_file: Callable[[], RecordFile], is_item: Callable[[Any], bool]) -> int | None:
    """How many of a file's records are items, counted up to its end or its first damage (None if
    it cannot be read at all): what setting it aside would withhold."""
    try:
        reader = open_file()
    except (OSError, CorruptJournalError):
        return None
    count = 0
    try:
        for record in reader:
            count += is_item(record)
    except CorruptJournalError:
        pass
    finally:
        reader.close()
    return count

@dataclass(frozen=True)
class Finding:
    """One damaged file: what is wrong with it, where, and what salvage does about it."""

    path: str
    why: str
    remedy: Remedy
    offset: int = 0
    opcode: int | None = None
    items: int | None = None  # items the remedy sets aside (None: not countable, the bytes are damaged)
    also: str = ""  # what else the remedy means (a reader served its items again)

    def plan(self) -> str:
        """What salvage does with this file, in a few words."""
        name = os.path.basename(self.path)
        if self.remedy is Remedy.SET_ASIDE:
            what = f"set aside {name}"
        elif self.remedy is Remedy.CUT:
            size = _size(self.path)
            rest = f", setting aside its last {size - self.offset} bytes" if size is not None else ""
            what = f"cut {name} at offset {self.offset}{rest}"
        else:
            return f"move nothing of {name} ({self.also or 'nothing to set aside'})"
        items = "" if self.items is None else f" ({self.items} items)"
        return what + items + (f" ({self.also})" if self.also else "")


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def plan(findings: Sequence[Finding]) -> str:
    """What `--salvage` would do, for a refusal and `kestrel journal check`."""
    steps = "; ".join(f.plan() for f in findings)
    return f"--salvage would {steps}, and keep every other file"


def refusal(findings: Sequence[Finding], context: str = "") -> CorruptJournalError:
    """The error that refuses a queue: the first damage, how many more, and the salvage plan."""
    first = findings[0]
    more = f" ({len(findings) - 1} more damaged file(s))" if len(findings) > 1 else ""
    return CorruptJournalError(first.path, first.offset, first.opcode, f"{first.why}{more}{context}",
                               plan=plan(findings))


def settle(queue_path: str, queue: str, findings: Sequence[Finding], salvage: bool, stamp: int,
           context: str = "") -> None:
    """Refuse the queue (raises CorruptJournalError, nothing moved) or, with `salvage`, carry out
    the remedy of every finding."""
    if not findings:
        return
    if not salvage:
        raise refusal(findings, context)
    carry_out(queue_path, queue, findings, stamp)


def carry_out(queue_path: str, queue: str, findings: Sequence[Finding], stamp: int) -> list[str]:
    """Set aside or cut what each finding says, keeping a copy of everything moved; the copies.

    Raises JournalWriteError when a copy cannot be written (a full disk): what was not moved yet
    stays as it was.
    """
    copies = []
    for finding in findings:
        path = finding.path
        log.error("damaged journal file (salvage)", queue=queue, file=path, offset=finding.offset,
                  reason=finding.why, remedy=finding.plan())
        try:
            if finding.remedy is Remedy.SET_ASIDE and os.path.exists(path):
                copies.append(layout.set_aside(queue_path, path, "corrupt", stamp))
            elif finding.remedy is Remedy.CUT and os.path.exists(path):
                aside = layout.aside_path(queue_path, os.path.basename(path), "corrupt", stamp)
                copies.append(cut_keeping_copy(path, finding.offset, aside))
        except OSError as e:
            raise JournalWriteError(queue, path, e) from None
    if copies:
        log.error("what salvage set aside is kept", queue=queue, copies=copies)
    return copies


def record_damage(error: CorruptJournalError, header: int = 0, also: str = "") -> Finding:
    """The finding of a damaged record (or a torn record before a later file): its file is cut
    there; set aside whole when the damage is in its `header` bytes (no file without them)."""
    if error.offset < header:
        return Finding(error.path, error.reason, Remedy.SET_ASIDE, error.offset, error.opcode, also=also)
    return Finding(error.path, error.reason, Remedy.CUT, error.offset, error.opcode, also=also)


def refuse_record(error: CorruptJournalError, header: int = 0, also: str = "") -> CorruptJournalError:
    """`error` (a damaged record) with the salvage plan attached."""
    error.plan = plan([record_damage(error, header, also)])
    return error
