"""Reading a Kestrel 2 journal's records back; what stops it is judged by the one torn-tail rule
(src/kestrel/storage/torn_tail.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from kestrel.storage import torn_tail
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.journal_file import BufferedFile
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.codec import Incomplete, Malformed, Record
from kestrel.storage.write_gate import WriteGate

SIZE_CHECK_WINDOW = 1 << 16  # bytes read past unreadable ones to look for a size field one bit small


class JournalReader(BufferedFile):
    """Reads records forward from one journal file, resuming where it stopped.

    The file may still be growing (the live journal, read by read-behind): `next()` returns None
    when no complete record is there yet, or where nothing but zeros follows (what a power cut can
    leave). With `check_sizes` (replay) a record whose size field looks one bit off is reported as
    corrupt. Replay asks `tail_damage` at the end whether what is left is a torn write.

    A record larger than the buffer is read whole in one read of the size its header gives, once
    the file is seen to hold that much (a damaged size allocates nothing: the record reads as
    incomplete, for the torn-tail rule to judge), never in chunks joined to each other. Its item is
    read on its own, as the item's bytes themselves; with `check_sizes` the whole record is read
    into one buffer instead (a size one bit off is looked for inside it) and the item copied out,
    and so is an opcode 8, with the byte after it (a CONTINUE or a STATE_DUMP by what follows).
    From `LARGE_APPEND` bytes the read runs off the loop through the `gate` of the journal's queue,
    and so does a fill of the buffer the page cache cannot answer (`BufferedFile.fill_at`).
    """

    def __init__(self, path: str, offset: int = 0, check_sizes: bool = False,
                 gate: WriteGate | None = None) -> None:
        super().__init__(path, offset, gate)
        self.check_sizes = check_sizes  # replay: look for size fields that swallow records
        self._previous: int | None = None  # offset of the record just read, if it has a size field
        self._eof = False

    def _fill(self) -> bool:
        """Read more of the file after the buffer; False at end of file."""
        rest = self._buf[self._pos:]
        self._buf_start += self._pos
        self._pos = 0
        want = max(self.chunk, len(rest))
        chunk = self.fill_at(want, self._buf_start + len(rest))
        self._buf = rest + chunk
        self._eof = len(chunk) < want
        return bool(chunk)

    def next(self) -> tuple[int, Record] | None:
        while True:
            try:
                record, stop = codec.decode(self._buf, self._pos, self._eof)
                if isinstance(record, codec.Remove | codec.RemoveTentative):
                    self._check_after_one_byte_record(record, stop)
                elif self.check_sizes and stop - self._pos > 21:
                    real_end = codec.misplaced_end(self._buf, self._pos, stop)
                    if real_end is not None:
                        raise Malformed(self._buf[self._pos],
                                        codec.size_damage(self.offset, self._buf_start + real_end))
            except Incomplete:
                extent = codec.item_extent(self._buf, self._pos)
                if extent is not None and extent[1] > self.chunk and len(self._buf) - self._pos <= extent[1]:
                    if not self._holds(extent[1]):
                        return None
                    told_by_what_follows = self._buf[self._pos] == codec.STATE_DUMP
                    if not self.check_sizes and not told_by_what_follows:
                        return self._read_item(*extent)
                    at, want = self.offset, extent[1] + told_by_what_follows
                    self._buf, self._buf_start, self._pos = self.read_at(want, at), at, 0
                    self._eof = len(self._buf) < want
                    continue
                was_eof = self._eof
                if not self._fill() and was_eof:
                    return None
                continue
            except Malformed as e:
                if self._zeros_to_end():
                    return None
                raise self._damage_before(e) or CorruptJournalError(self.path, self.offset, e.opcode,
                                                                    e.reason) from None
            at = self.offset
            self._pos = stop
            self._previous = at if isinstance(record, codec.SIZED_RECORDS) else None
            return at, record

    def _holds(self, size: int) -> bool:
        """Whether the file holds the `size` bytes of the record here (else it is at its end)."""
        self._eof = self.offset + size > os.fstat(self.fd).st_size
        return not self._eof

    def _read_item(self, start: int, end: int) -> tuple[int, Record] | None:
        """The item record here, its item read on its own from `start` to `end` (from the record's
        offset); None if the file turns out shorter. The reader's place is taken from before the
        read, which may have let the loop run."""
        at = self.offset
        head = self._buf[self._pos:self._pos + start]
        data = self.read_at(end - start, at + start)
        if len(data) < end - start:
            self._eof = True
            return None
        self._buf, self._buf_start, self._pos = b"", at + end, 0
        self._previous = at
        return at, codec.item_record(head, data)

    def common_run(self, budget: int) -> list[codec.Common]:
        """The run of common records whole in the buffer from here (`codec.decode_common`), read.

        Empty when the next record needs `next()`: another kind, not yet read from the file,
        damaged, or an add past `budget` bytes of data. Records are checked as `next()` checks them.
        """
        run, self._pos, previous = codec.decode_common(self._buf, self._pos, self._buf_start, budget,
                                                       self.check_sizes)
        if run:
            self._previous = self._buf_start + previous if previous >= 0 else None
        return run

    def common_columns(self, budget: int) -> codec.CommonColumns:
        """`common_run`'s records as column buffers (`codec.decode_common_columns`)."""
        columns, self._pos, previous = codec.decode_common_columns(self._buf, self._pos, self._buf_start,
                                                                   budget, self.check_sizes)
        if columns[0]:
            self._previous = self._buf_start + previous if previous >= 0 else None
        return columns

    def _damage_before(self, error: Malformed) -> CorruptJournalError | None:
        """The record just before unreadable bytes, if its size field looks one bit too small.

        A size one bit too small ends a record inside its own data, which then reads as garbage:
        the record at fault is the one before, and it is named instead of the garbage. Not when
        whole records already start between the garbage and that end: stray bytes explain it too.
        """
        previous = self._previous
        if not self.check_sizes or previous is None:
            return None
        window = os.pread(self.fd, self.offset - previous + SIZE_CHECK_WINDOW, previous)
        chains = torn_tail.Chains(window, len(window), codec.TAIL_RECORDS)
        end = codec.misplaced_end(window, 0, len(window), grow=True, fills=chains.whole_records_at)
        unreadable = self.offset - previous
        if end is None or codec.resyncs_between(chains, unreadable + 1, end):
            return None
        return CorruptJournalError(self.path, previous, window[0], codec.size_damage(previous, previous + end)
                                   + f" (the bytes at offset {self.offset} are unreadable: {error.reason})")

    def _check_after_one_byte_record(self, record: Record, stop: int) -> None:
        """A REMOVE or REMOVE_TENTATIVE must be followed by an opcode (or the end of the file).

        If it is not, the one-byte record is most likely the damaged one (an add whose opcode byte
        was overwritten): the error names its offset, and nothing of it is applied.
        """
        if stop >= len(self._buf):
            if not self._eof:
                raise Incomplete
            return
        following = self._buf[stop]
        if following > codec.MAX_OPCODE:
            name = codec.OPCODE_NAMES[type(record)]
            raise Malformed(self._buf[self._pos], f"{name} at offset {self.offset} is followed by "
                                f"unknown opcode {following} at offset {self.offset + 1}: the record at "
                                f"{self.offset} is damaged (likely an add whose opcode byte was overwritten)")

    def _zeros_to_end(self) -> bool:
        """Whether nothing but zeros follows the current position, to the end of the file."""
        if self._buf[self._pos:].strip(b"\0"):
            return False
        at = self._buf_start + len(self._buf)
        while chunk := os.pread(self.fd, self.chunk, at):
            if chunk.strip(b"\0"):
                return False
            at += len(chunk)
        return True

    def leftover(self) -> int:
        """Bytes after the last complete record (non-zero means a torn tail, or damage)."""
        size = os.fstat(self.fd).st_size
        return size - self.offset

    def tail_damage(self, last: bool) -> CorruptJournalError | None:
        """What `leftover` bytes are: None for a torn write (`last`: the queue's last file), else the
        damage (src/kestrel/storage/torn_tail.py)."""
        left = self.leftover()
        opcode = self._buf[self._pos] if self._pos < len(self._buf) else None
        return torn_tail.judge(self.path, self.offset, f"{left} bytes of an incomplete record",
                               codec.TAIL_RECORDS, last, opcode=opcode)

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        while (entry := self.next()) is not None:
            yield entry


def read_journal(path: str) -> Iterator[tuple[int, Record]]:
    """Every complete record of one file with its offset; a torn tail is simply not yielded."""
    reader = JournalReader(path)
    try:
        yield from reader
    finally:
        reader.close()
