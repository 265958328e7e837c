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
- anything that cannot be read whole in a file that is not the log's last (a Kestrel 3 file's end
  is always judged as a last file's: `kestrel3.files.RecordReader.tail_damage` says why).

A file laid down ahead (zeros written and made durable before records are written over them by
position: the commit log's segments) ends where its zeros begin: nothing but zeros from there to
its end is its clean end (`ends_cleanly`), neither torn nor damaged. A record cut short there, or
any byte that is not zero after the zeros, is judged by the rules above.

Each format says only how its records read (`Records`): where whole records could start inside a
record, and how one record at a place reads. The decision is here, once, and so is the reading on
from each place (`Chains`): every place's chain of records is read at most once and each chain stops
once its evidence is met, so judging takes time linear in the bytes judged (item data that reads as
a chain of records from every place would otherwise be read again from each).
"""

from __future__ import annotations

import os
import re
from array import array
from typing import Protocol

from kestrel.storage.disk import open_to_read
from kestrel.storage.errors import CorruptJournalError

# Past this many bytes after a record that cannot be read whole, whole records are looked for in
# this window only: two whole records there are evidence enough.
SCAN_WINDOW = 16 << 20


class Records(Protocol):
    """How one log format's records read, for the rule (each format supplies one)."""

    def body_start(self, tail: bytes) -> int:
        """Where whole records could start inside the record at `tail[0]`: after its size field."""

    def starts(self, tail: bytes) -> re.Pattern[bytes] | None:
        """Where in `tail` a record could start: a pattern that matches there (a byte, or a look
        ahead at a record's head), and need not elsewhere; None: anywhere. Places it passes over are
        passed in one search, none read: it must match wherever `record_at` reads a record."""

    # Whole records start at a place when, reading on, the records count at least this many (as
    # `record_at` counts them) on reaching the end (where the file's trailing zeros start, or the
    # window's end), or this many before the bytes stop making sense.
    evidence_at_end: int
    evidence_before_nonsense: int

    def record_at(self, tail: bytes, pos: int) -> tuple[int, int] | None:
        """The record at `pos` if it reads whole within `tail` (its data is not copied): where it
        ends and whether it counts as evidence (1) or not (0); None if it does not read."""

    def explain(self, tail: bytes, end: int, offset: int, chains: Chains) -> str | None:
        """A sharper account of the damage at `offset` than "whole records start inside it", if the
        format has one (a size field one bit off), else None. `chains`: where whole records start,
        reading on to the end of `tail`."""


def cut_note(path: str, offset: int) -> str:
    """What the tools say of a torn tail they found: what the next start does with it."""
    return (f"{os.path.basename(path)} ends in a torn write at offset {offset}: the next start cuts it off, "
            "a copy kept")


def read_tail(path: str, offset: int) -> tuple[bytes, bool]:
    """The bytes of `path` from `offset` (at most `SCAN_WINDOW`), and whether they run to its end."""
    with open_to_read(path) as f:
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
    chains = Chains(data, len(data), records)
    explained = records.explain(data, end, offset, chains)
    if explained is not None:
        return CorruptJournalError(path, offset, opcode, explained)
    # What the account read is the search's too where both read on to the same end (no zeros after)
    inside = first_whole_records(data, records.body_start(data), end, records,
                                 chains if end == len(data) else None)
    if inside is None:
        return None
    return CorruptJournalError(path, offset, opcode, (
        f"{why}, but whole records start inside it at offset {offset + inside} and run on to the end "
        f"({len(data)} bytes): its size field or its bytes are damaged, this is not a torn write"))


def first_whole_records(tail: bytes, start: int, end: int, records: Records,
                        chains: Chains | None = None) -> int | None:
    """The first place in `tail[start:end]` where whole records start, or None. `chains`: what was
    read of `tail`'s chains to `end` already, if anything."""
    if chains is None:
        chains = Chains(tail, end, records)
    starts = records.starts(tail)
    pos = max(start, 1)
    while pos < end:
        pos = chains.unread(pos)
        if starts is not None and pos < end:  # (a head may run on past `end`, into the zeros: searched too)
            found = starts.search(tail, pos)
            if found is None:
                return None
            pos = found.start()
            if pos >= end:
                return None
        if chains.whole_records_at(pos):
            return pos
        pos += 1
    return None


def any_of(first_bytes: bytes) -> re.Pattern[bytes]:
    """`Records.starts` for a format whose records begin with one of `first_bytes`."""
    return re.compile(b"[" + re.escape(first_bytes) + b"]")


# What `Chains` knows of a place: not read yet, or how many records count from it (up to the
# evidence asked for) and whether that chain reached the end or met nonsense.
_UNKNOWN = 0
_REACHED = 1
_STOPPED = 2


class Chains:
    """Where whole records start in `tail`, reading on to `end`, each place's chain read once.

    A place's chain is the place's record, then the chain of the place where it ends: what a place
    was found to read to is kept (its count, saturated at the evidence asked for, and how its chain
    ended), and a later chain that meets a place already read takes its answer from there. A chain
    stops as soon as its count is evidence whatever follows.
    """

    def __init__(self, tail: bytes, end: int, records: Records) -> None:
        self.tail = tail
        self.end = end
        self.records = records
        self.enough = max(records.evidence_at_end, records.evidence_before_nonsense)
        self._known = bytearray(end)  # per place: _UNKNOWN, or 4 * count + how its chain ended
        self._evidence_seen = False  # whether a place asked about was evidence

    def whole_records_at(self, pos: int) -> bool:
        count, ended = self._read_on(pos)
        evidence = count >= self.enough or count >= (
            self.records.evidence_at_end if ended == _REACHED else self.records.evidence_before_nonsense)
        self._evidence_seen = self._evidence_seen or evidence
        return evidence

    def unread(self, pos: int) -> int:
        """The first place from `pos` whose chain was not read (`end` if none), while no place asked
        about was evidence: then no place read is (each lies on the chain of a place asked about, its
        chain ending alike, counting no more), and a search for the first that is passes over them
        in one step (item data that reads as one chain of records from every place)."""
        if self._evidence_seen:
            return pos
        found = self._known.find(_UNKNOWN, pos)
        return self.end if found < 0 else found

    def _read_on(self, pos: int) -> tuple[int, int]:
        """How many records count from `pos` (at most `enough`) and how the chain ended; keeps the
        same for every place the chain passed."""
        known, tail, end, enough = self._known, self.tail, self.end, self.enough
        if pos >= end:
            return 0, _REACHED
        if known[pos] != _UNKNOWN:
            return known[pos] >> 2, known[pos] & 3
        record_at = self.records.record_at
        record = record_at(tail, pos)
        if record is None:  # most places of a torn record: nothing to keep but this
            known[pos] = _STOPPED
            return 0, _STOPPED
        places = array("q")  # the places this chain read, and what each counted
        counts = bytearray()
        found = 0
        at = pos
        while True:
            places.append(at)
            counts.append(record[1])
            found += record[1]
            at = record[0]
            if found >= enough:  # evidence whatever follows: the places near the stop are left unknown
                base, ended = 0, _STOPPED
                break
            if at >= end:
                base, ended = 0, _REACHED
                break
            if known[at] != _UNKNOWN:
                base, ended = known[at] >> 2, known[at] & 3
                break
            next_record = record_at(tail, at)
            if next_record is None:
                base, ended = 0, _STOPPED
                break
            record = next_record
        total = base
        for i in range(len(places) - 1, -1, -1):
            total = min(enough, total + counts[i])
            if found < enough or total == enough:
                known[places[i]] = total << 2 | ended
        return total, ended
