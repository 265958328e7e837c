"""The one torn-tail rule, for every log the server reads: Kestrel 2 journals, Kestrel 3 writer
files and reader checkpoints, the commit log's segments.

A crash tears only the last write. What it leaves after the last whole record of a log's last file
is the start of one record (as many of its bytes as reached the disk), or zeros (after a power cut
a file's new size can reach the disk before its data). That was never acknowledged: it is a torn
tail, cut off with a copy kept. Anything else that stops a reader is damage, refused naming the
file and the offset:

- bytes that cannot start a record, unless nothing but zeros follows them;
- a record that cannot be read whole (it runs past the end, its checksum fails) while whole records
  start inside or after it: its size field, or whatever else made it unreadable, is damaged, and
  cutting there would drop every record after it;
- anything that cannot be read whole in a file that is not the log's last.

A file laid down ahead (zeros written and made durable before records are written over them by
position: the commit log's segments) ends where its zeros begin: nothing but zeros from there to
its end is its clean end (`ends_cleanly`), neither torn nor damaged. A record cut short there, or
any byte that is not zero after the zeros, is judged by the rules above.

Each format says only how its records read (`Records`): where whole records could start inside a
record, and whether they start at a place. The decision is here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kestrel.storage.errors import CorruptJournalError

# Past this many bytes after a record that cannot be read whole, whole records are looked for in
# this window only: two whole records there are evidence enough.
SCAN_WINDOW = 16 << 20


class Records(Protocol):
    """How one log format's records read, for the rule (each format supplies one)."""

    def body_start(self, tail: bytes) -> int:
        """Where whole records could start inside the record at `tail[0]`: after its size field."""

    def whole_records_at(self, tail: bytes, pos: int, end: int) -> bool:
        """Whether whole records start at `pos`: reading on, they reach `end` (where the file's
        trailing zeros start, or the window's end) with at least one record, or give at least two
        whole records before the bytes stop making sense."""

    def explain(self, tail: bytes, end: int, offset: int) -> str | None:
        """A sharper account of the damage at `offset` than "whole records start inside it", if the
        format has one (a size field one bit off), else None."""


def read_tail(path: str, offset: int) -> tuple[bytes, bool]:
    """The bytes of `path` from `offset` (at most `SCAN_WINDOW`), and whether they run to its end."""
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read(SCAN_WINDOW + 1)
    return tail[:SCAN_WINDOW], len(tail) <= SCAN_WINDOW


def zeros_only(tail: bytes) -> bool:
    """Nothing but zeros (or nothing): what a power cut leaves where data had not reached the disk."""
    return not tail.strip(b"\0")


def ends_cleanly(data: bytes, at: int) -> bool:
    """Whether a file laid down ahead ends at `at`: nothing but its zeros follow to its end."""
    return len(data.rstrip(b"\0")) <= at


def judge(path: str, offset: int, why: str, records: Records, last: bool, startable: bool = True,
          opcode: int | None = None, tail: tuple[bytes, bool] | None = None) -> CorruptJournalError | None:
    """Whether what stops a reader of `path` at `offset` is a torn tail (None) or damage (the error
    to raise). `why` says what the reader found there; `last`: the log's last file (only there can a
    write be torn); `startable`: the bytes there can begin a record of the format (else only zeros
    may follow them). `tail`: the bytes from `offset` when the caller holds them (`read_tail`)."""
    if not last:
        return CorruptJournalError(path, offset, opcode, f"{why}, before the next file of the log")
    data, at_end = tail if tail is not None else read_tail(path, offset)
    if zeros_only(data) and at_end:
        return None
    if not startable:
        return CorruptJournalError(path, offset, opcode, why)
    end = len(data.rstrip(b"\0")) if at_end else len(data)
    explained = records.explain(data, end, offset)
    if explained is not None:
        return CorruptJournalError(path, offset, opcode, explained)
    inside = first_whole_records(data, records.body_start(data), end, records.whole_records_at)
    if inside is None:
        return None
    return CorruptJournalError(path, offset, opcode, (
        f"{why}, but whole records start inside it at offset {offset + inside} and run on to the end "
        f"({len(data)} bytes): its size field or its bytes are damaged, this is not a torn write"))


def first_whole_records(tail: bytes, start: int, end: int,
                        whole_records_at: Callable[[bytes, int, int], bool]) -> int | None:
    """The first place in `tail[start:end]` where whole records start, or None."""
    for pos in range(max(start, 1), end):
        if whole_records_at(tail, pos, end):
            return pos
    return None
