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
its end is its clean end (`Held.ends_cleanly`), neither torn nor damaged. A record cut short there, or
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

    def body_start(self, data: bytes, at: int) -> int:
        """Where whole records could start inside the record at `data[at]`: after its size field."""

    def starts(self, data: bytes) -> re.Pattern[bytes] | None:
        """Where in `data` a record could start: a pattern that matches there (a byte, or a look
        ahead at a record's head), and need not elsewhere; None: anywhere. Places it passes over are
        passed in one search, none read: it must match wherever `record_at` reads a record."""

    # Whole records start at a place when, reading on, the records count at least this many (as
    # `record_at` counts them) on reaching the end (where the file's trailing zeros start, or the
    # window's end), or this many before the bytes stop making sense.
    evidence_at_end: int
    evidence_before_nonsense: int

    def record_at(self, data: bytes, pos: int) -> tuple[int, int] | None:
        """The record at `pos` if it reads whole within `data` (its bytes are not copied): where it
        ends and whether it counts as evidence (1) or not (0); None if it does not read."""

    def explain(self, data: bytes, at: int, end: int, offset: int, chains: Chains) -> str | None:
        """A sharper account of the damage at `data[at]` (the file's `offset`) than "whole records
        start inside it", if the format has one (a size field one bit off), else None. `chains`:
        where whole records start, reading on to the end of `data`."""


def cut_note(path: str, offset: int) -> str:
    """What the tools say of a torn tail they found: what the next start does with it."""
    return (f"{os.path.basename(path)} ends in a torn write at offset {offset}: the next start cuts it off, "
            "a copy kept")


class Held:
    """Bytes of a log file held for the rule: `data`, from the file's offset `base`, to its end
    (`at_end`) or a window of it. A reader judging place after place of one file it holds whole
    (the commit log's segments, read on past damage) judges them all with one: the end before its
    trailing zeros found once, and each place's chain read once for every judgement, so that judging
    a file takes time linear in its bytes (a copy of what follows each place, with a memo of its
    own, took time growing with places × bytes)."""

    def __init__(self, data: bytes, records: Records, base: int = 0, at_end: bool = True) -> None:
        self.data = data
        self.records = records
        self.base = base
        self.at_end = at_end
        self.end = len(data.rstrip(b"\0")) if at_end else len(data)  # where the last record could end
        self._chains: dict[int, Chains] = {}
        self._resumes: dict[int, int | None] = {}

    def ends_cleanly(self, offset: int) -> bool:
        """Whether nothing but zeros follows `offset` to the file's end: where a file laid down ahead
        ends cleanly, and what a power cut leaves of data that had not reached the disk."""
        return self.at_end and self.end <= offset - self.base

    def resumes(self, at: int) -> int | None:
        """Where whole records start inside or after the unreadable record at `data[at]`, reading on
        to the end before the zeros (None: nowhere): searched once for each place, which the
        judgement and a reader going on past damage both ask."""
        if at not in self._resumes:
            start = self.records.body_start(self.data, at)
            self._resumes[at] = first_whole_records(self.data, start, self.end, self.records,
                                                    self.chains(self.end, at))
        return self._resumes[at]

    def chains(self, end: int, start: int) -> Chains:
        """Where whole records start in `data` from `start`, reading on to `end`: one for each end
        asked, kept while later judgements ask from further on (a file is judged from its start on)."""
        chains = self._chains.get(end)
        if chains is None or chains.start > start:
            chains = self._chains[end] = Chains(self.data, end, self.records, start)
        return chains


def read_tail(path: str, offset: int, records: Records) -> Held:
    """The bytes of `path` from `offset` (at most `SCAN_WINDOW`), knowing whether they run to its end."""
    with open_to_read(path) as f:
        f.seek(offset)
        tail = f.read(SCAN_WINDOW + 1)
    return Held(tail[:SCAN_WINDOW], records, offset, len(tail) <= SCAN_WINDOW)


def zeros_only(tail: bytes) -> bool:
    """Nothing but zeros (or nothing): what a power cut leaves where data had not reached the disk."""
    return not tail.strip(b"\0")


def judge(path: str, offset: int, why: str, records: Records, last: bool, startable: bool = True,
          opcode: int | None = None, held: Held | None = None) -> CorruptJournalError | None:
    """Whether what stops a reader of `path` at `offset` is a torn tail (None) or damage (the error
    to raise). `why` says what the reader found there; `last`: the log's last file (only there can a
    write be torn); `startable`: the bytes there can begin a record of the format (else only zeros
    may follow them). `held`: the file's bytes, from `offset` or before, when the caller holds them
    (held for these `records`)."""
    if not last:
        return CorruptJournalError(path, offset, opcode, f"{why}, before the next file of the log")
    if held is None:
        held = read_tail(path, offset, records)
    if held.ends_cleanly(offset):  # nothing but zeros, as a power cut leaves
        return None
    data, at, end = held.data, offset - held.base, held.end
    if not startable:
        return CorruptJournalError(path, offset, opcode, why)
    # What the account reads is the search's too where both read on to the same end (no zeros after)
    explained = records.explain(data, at, end, offset, held.chains(len(data), at))
    if explained is not None:
        return CorruptJournalError(path, offset, opcode, explained)
    inside = held.resumes(at)
    if inside is None:
        return None
    return CorruptJournalError(path, offset, opcode, (
        f"{why}, but whole records start inside it at offset {held.base + inside} and run on to the end "
        f"({len(data) - at} bytes): its size field or its bytes are damaged, this is not a torn write"))


def first_whole_records(data: bytes, start: int, end: int, records: Records,
                        chains: Chains | None = None) -> int | None:
    """The first place in `data[start:end]` where whole records start, or None. `chains`: what was
    read of `data`'s chains to `end` already, if anything."""
    if chains is None:
        chains = Chains(data, end, records, start)
    starts = records.starts(data)
    pos = max(start, 1)
    while pos < end:
        pos = chains.unread(pos)
        if starts is not None and pos < end:  # (a head may run on past `end`, into the zeros: searched too)
            found = starts.search(data, pos)
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
    stops as soon as its count is evidence whatever follows. No place before `start` is asked about
    (a file held whole is judged from its first unreadable record on: what is kept of each place
    need not span the records before).
    """

    def __init__(self, tail: bytes, end: int, records: Records, start: int = 0) -> None:
        self.tail = tail
        self.end = end
        self.start = start
        self.records = records
        self.enough = max(records.evidence_at_end, records.evidence_before_nonsense)
        # per place from `start`: _UNKNOWN, or 4 * count + how its chain ended
        self._known = bytearray(max(end - start, 0))
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
        found = self._known.find(_UNKNOWN, pos - self.start)
        return self.end if found < 0 else found + self.start

    def _read_on(self, pos: int) -> tuple[int, int]:
        """How many records count from `pos` (at most `enough`) and how the chain ended; keeps the
        same for every place the chain passed."""
        known, tail, end, enough, first = self._known, self.tail, self.end, self.enough, self.start
        if pos >= end:
            return 0, _REACHED
        if known[pos - first] != _UNKNOWN:
            return known[pos - first] >> 2, known[pos - first] & 3
        record_at = self.records.record_at
        record = record_at(tail, pos)
        if record is None:  # most places of a torn record: nothing to keep but this
            known[pos - first] = _STOPPED
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
            if known[at - first] != _UNKNOWN:
                base, ended = known[at - first] >> 2, known[at - first] & 3
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
                known[places[i] - first] = total << 2 | ended
        return total, ended
