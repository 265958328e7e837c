"""Kestrel 3's run decoder: the compiled one (src/kestrel/storage/kestrel3/_codec.c) against the Python
loop it stands in for, and both against the record-by-record decoder; and a queue loaded through runs
against the items it was given, with large items, damage and a torn tail where runs stop.

Both decoders read writer journals of PUTs with and without expiry, large ids, times and error
counts, from every starting position, and after random bytes are overwritten, cut off or flipped:
the rows and the positions they stop at must be the same, and every row must be the record `decode`
reads there.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.journal_file import READ_CHUNK
from kestrel.storage.kestrel2.codec import Incomplete, Malformed
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import RecordReader, list_queue_files
from tests.support.damaged_bytes import damaged

try:
    from kestrel.storage.kestrel3 import _codec as compiled
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    compiled = None


def random_puts(rng: random.Random, count: int) -> bytes:
    out = []
    item_id = rng.choice((1, 2**32 - 3, 2**63 - 10, 2**64 - count - 1))
    for _ in range(count):
        data = bytes(rng.choice((0x86, 0x88, 0x02, 0x92, 0x00, 0xFF)) for _ in range(rng.choice((0, 1, 7, 40))))
        expire = rng.choice((None, 0, -1, 2**63 - 1, 1_700_000_000_000))
        out.append(k3.encode(k3.Put(item_id, rng.choice((0, 1, 2**31 - 1)),
                                    rng.choice((0, -5, 1_700_000_000_000, 2**63 - 1)), expire, data)))
        item_id += 1
    return b"".join(out)


def decoded_one_by_one(buf: bytes, pos: int) -> list[k3.PutRow]:
    """What `decode` reads from `pos` up to the first record that is not a whole valid PUT."""
    rows: list[k3.PutRow] = []
    while True:
        try:
            record, stop = k3.decode(buf, pos, k3.FileKind.WRITER)
        except (Incomplete, Malformed):
            return rows
        assert isinstance(record, k3.Put)
        rows.append((record.id, record.error_count, record.add_time, record.expire_time, record.data))
        pos = stop


def check(buf: bytes, pos: int) -> None:
    rows, stop = k3.decode_puts_python(buf, pos)
    assert rows == decoded_one_by_one(buf, pos)
    assert stop == pos + sum(len(k3.encode(k3.Put(*row))) for row in rows)
    if compiled is not None:
        assert compiled.decode_puts(buf, pos) == (rows, stop)


@pytest.mark.parametrize("seed", range(8))
def test_the_runs_are_the_records_decode_reads(seed: int) -> None:
    rng = random.Random(seed)
    buf = random_puts(rng, 60)
    for pos in range(0, len(buf) + 2):
        check(buf, pos)
    for _ in range(80):
        broken = damaged(rng, buf)
        check(broken, rng.randrange(len(broken) // 4))


@pytest.mark.skipif(compiled is None, reason="built without a C compiler")
def test_the_compiled_decoder_refuses_what_the_python_one_does() -> None:
    assert compiled is not None
    with pytest.raises(ValueError, match="negative position"):
        compiled.decode_puts(b"", -1)
    with pytest.raises(ValueError, match="negative position"):
        k3.decode_puts_python(b"", -1)
    with pytest.raises(TypeError):
        compiled.decode_puts(bytearray(b"x"), 0)  # type: ignore[arg-type]


def put_items(path: Path, count: int) -> list[bytes]:
    """`count` items in a Kestrel 3 queue of small files, of many sizes, every 1,000th over the
    reader's buffer (a read of its own)."""
    coll = QueueCollection(str(path), QueueConfigs({"journal_format": "kestrel3", "default_journal_size": "64KB"}))
    coll.load()
    sizes = (0, 1, 100, 5000)
    items = [bytes([i % 251]) * (READ_CHUNK + 7 if i % 1000 == 999 else sizes[i % 4]) for i in range(count)]
    for at in range(0, count, 50):
        assert coll.put("q", items[at:at + 50]) == len(items[at:at + 50])
    coll.close()
    return items


def test_a_queue_loads_its_items_in_order_across_runs_files_and_large_items(tmp_path: Path) -> None:
    items = put_items(tmp_path, 3000)
    assert len(list_queue_files(str(tmp_path), "q").writers) > 3
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3", "max_memory_size": "1GB"}))
    coll.load()
    got: list[bytes] = []
    while taken := coll.remove("q", count=500):
        got += [item.data for item in taken]
    coll.close()
    assert got == items


def writer_file(path: Path, records: list[bytes]) -> str:
    path.write_bytes(k3.WRITER_MAGIC + b"".join(records))
    return str(path)


def test_a_run_stops_at_damage_and_the_record_is_refused_where_it_is(tmp_path: Path) -> None:
    records = [k3.encode(k3.Put(i, 0, 0, None, b"x" * 10)) for i in range(1, 201)]
    offset = 4 + sum(len(r) for r in records[:100])
    records[100] = bytes([0x02]) + records[100][1:]  # a READ_HEAD's command byte: no place in a writer journal
    reader = RecordReader(writer_file(tmp_path / "q.1", records), k3.FileKind.WRITER)
    ids: list[int] = []
    with pytest.raises(CorruptJournalError) as refused:
        while run := reader.puts():
            ids += [row[0] for row in run]
    reader.close()
    assert ids == list(range(1, 101))
    assert refused.value.offset == offset


def test_a_run_ends_at_a_torn_tail_with_every_whole_record_read(tmp_path: Path) -> None:
    records = [k3.encode(k3.Put(i, 0, 0, i * 3, b"y" * i)) for i in range(1, 101)]
    whole = writer_file(tmp_path / "q.1", records)
    with open(whole, "ab") as f:
        f.write(k3.encode(k3.Put(101, 0, 0, None, b"z" * 50))[:30])
    reader = RecordReader(whole, k3.FileKind.WRITER)
    rows: list[k3.PutRow] = []
    while run := reader.puts():
        rows += run
    assert rows == [(i, 0, 0, i * 3, b"y" * i) for i in range(1, 101)]
    assert reader.torn is not None and "runs past the end of the file" in reader.torn
    assert reader.offset == 4 + sum(len(r) for r in records)
    reader.close()
