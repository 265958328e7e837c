"""Reading a Kestrel 2 journal's records back, and telling a torn tail from damage."""

from __future__ import annotations

import os
from collections.abc import Iterator

from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.journal_file import BufferedFile
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.codec import Incomplete, Malformed, Record

SIZE_CHECK_WINDOW = 1 << 16  # bytes read past unreadable ones to look for a size field one bit small


class JournalReader(BufferedFile):
    """Reads records forward from one journal file, resuming where it stopped.

    The file may still be growing (the live journal, read by read-behind): `next()` returns None
    when no complete record is there yet. With `check_sizes` (replay) a record whose size field
    looks one bit off is reported as corrupt. Replay calls `finish()` at the end to learn whether the
    file ends in a torn record.
    """

    def __init__(self, path: str, offset: int = 0, check_sizes: bool = False) -> None:
        super().__init__(path, offset)
        self.check_sizes = check_sizes  # replay: look for size fields that swallow records
        self._previous: int | None = None  # offset of the record just read, if it has a size field
        self._eof = False

    def _fill(self) -> bool:
        """Read more of the file after the buffer; False at end of file."""
        rest = self._buf[self._pos:]
        self._buf_start += self._pos
        self._pos = 0
        want = max(self.chunk, len(rest))
        chunk = os.pread(self.fd, want, self._buf_start + len(rest))
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
                                        _size_damage(self.offset, self._buf_start + real_end))
            except Incomplete:
                was_eof = self._eof
                if not self._fill() and was_eof:
                    return None
                continue
            except Malformed as e:
                raise self._damage_before(e) or CorruptJournalError(self.path, self.offset, e.opcode,
                                                                    e.reason) from None
            at = self.offset
            self._pos = stop
            self._previous = at if isinstance(record, codec.SIZED_RECORDS) else None
            return at, record

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
        end = codec.misplaced_end(window, 0, len(window), grow=True)
        unreadable = self.offset - previous
        if end is None or codec.resyncs_between(window, unreadable + 1, end, len(window)):
            return None
        return CorruptJournalError(self.path, previous, window[0], _size_damage(previous, previous + end)
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

    def leftover(self) -> int:
        """Bytes after the last complete record (non-zero means a torn tail)."""
        size = os.fstat(self.fd).st_size
        return size - self.offset

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        while (entry := self.next()) is not None:
            yield entry


def torn_tail_damage(path: str, offset: int) -> str | None:
    """Why the incomplete record at `offset` (the end of the last file) is damage, not a torn write.

    A torn write leaves the first bytes of one record; a damaged size field leaves a record that
    claims to run past the end while whole records follow it (`codec.misplaced_end` for a size one
    bit off; `codec.records_inside` for any other damage to it).
    """
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read()
    end = codec.misplaced_end(tail, 0, len(tail))
    if end is not None:
        return _size_damage(offset, offset + end)
    inside = codec.records_inside(tail, 0, len(tail))
    if inside is None:
        return None
    return (f"the record at offset {offset} claims to run past the end of the file, but whole records "
            f"start inside it at offset {offset + inside} and run to the end ({len(tail)} bytes): its "
            "size field is damaged, this is not a torn write")


def _size_damage(offset: int, real_end: int) -> str:
    return (f"the size field of the record at offset {offset} looks damaged: with one bit changed it "
            f"would end at offset {real_end}, where whole records follow")


def read_journal(path: str) -> Iterator[tuple[int, Record]]:
    """Every complete record of one file with its offset; a torn tail is simply not yielded."""
    reader = JournalReader(path)
    try:
        yield from reader
    finally:
        reader.close()
