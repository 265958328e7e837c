"""Damage a Kestrel 2 or Kestrel 3 queue's bytes cannot show: the manifest sees it (issue 26).

Each damaged directory is built here: items written through the library, the collection closed,
the files damaged, the collection opened again.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kestrel.storage import QueueCollection, QueueConfigs, disk, filenames, manifest
from kestrel.storage.clock import FakeClock
from kestrel.storage.crc32c import crc32c, crc32c_python
from kestrel.storage.errors import CorruptJournalError, QueueDamaged
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.kestrel2.journal import QueueJournal
from kestrel.storage.kestrel2.reader import read_journal
from kestrel.storage.runtime import ThreadsRuntime
from tests.support.crash_points import InlineRuntime
from tests.support.power_loss import Disk
from tests.support.queues import aside, drain, journal_files, load_strictly, manifest_path, one

ITEM = b"x" * 200


def k2(path: Path, salvage: bool = False, **settings: Any) -> QueueCollection:
    q = {"max_memory_size": 4096, "max_journal_size": 1 << 30, **settings}
    coll = QueueCollection(str(path), QueueConfigs({}, {"q": q}), salvage=salvage)
    return load_strictly(coll)  # a refused queue's CorruptJournalError, raised


def rotated(path: Path) -> list[str]:
    return sorted((n for n in os.listdir(path) if n.startswith("q.") and n[2:].isdigit()),
                  key=lambda n: int(n[2:]))


def listing(path: Path) -> dict[str, bytes]:
    """Every file under the queue path (the server's own directory included) but the lock, by path."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != "lock"}


def refused(path: Path, load: Callable[[], object], *named: str) -> None:
    """`load` refuses the queue path with a message (and remedy) naming each of `named`, and changes
    nothing there (no file cut, deleted or set aside on the strength of what did not verify)."""
    before = listing(path)
    with pytest.raises(CorruptJournalError) as err:
        load()
    message = f"{err.value}; {err.value.remedy()}"
    assert all(part in message for part in named), message
    assert listing(path) == before


def test_crc32c_compiled_matches_the_python_reference() -> None:
    assert crc32c(b"123456789") == crc32c_python(b"123456789") == 0xE3069283  # the standard check value
    data = os.urandom(10_000)
    assert crc32c(data[5000:], crc32c(data[:5000])) == crc32c_python(data)


def test_file_crc32c_of_whole_files_and_prefixes_across_its_buffer(tmp_path: Path) -> None:
    from kestrel.storage.crc32c import file_crc32c
    data = os.urandom((3 << 20) + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    for size in (None, 0, 1, 5000, 1 << 20, (1 << 20) + 7, len(data)):
        assert file_crc32c(str(path), size) == crc32c(data if size is None else data[:size])
    with pytest.raises(OSError, match="fewer than"):
        file_crc32c(str(path), len(data) + 1)


def test_manifest_name_is_no_queue_and_no_other_file_kind() -> None:
    from kestrel.storage import filenames
    assert filenames.parse_journal_name(filenames.manifest_name("q")) is None
    assert filenames.reader_of("q", filenames.manifest_name("q")) is None
    assert filenames.writer_file_number("q", filenames.manifest_name("q")) is None
    assert filenames.is_temporary(filenames.manifest_temporary_name("q"))


def test_damaged_manifest_is_refused(tmp_path: Path) -> None:
    coll = k2(tmp_path)
    for _ in range(100):
        coll.put("q", [ITEM])
    coll.close()
    path = manifest_path(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    refused(tmp_path, lambda: k2(tmp_path), "checksum", "--salvage would set aside q.manifest")


@pytest.mark.parametrize("files, why", [
    (b'{"q.1": [Infinity, null, 0, 0]}', "cannot convert float infinity to integer"),
    (b"[" * 100_000 + b"]" * 100_000, "maximum recursion depth"),
])
def test_a_manifest_whose_checksum_holds_and_whose_fields_cannot_be_read_is_refused(
        tmp_path: Path, files: bytes, why: str) -> None:
    """Crafted, its checksum made anew: an int of `Infinity`, or nesting past Python's limit, raised
    out of the start (OverflowError, RecursionError) where other unreadable fields were refused."""
    coll = k2(tmp_path)
    coll.put("q", [ITEM])
    coll.close()
    body = b'{"format": "kestrel2", "high_id": 0, "files": ' + files + b', "packs": []}'
    manifest_path(tmp_path).parent.mkdir(exist_ok=True)
    manifest_path(tmp_path).write_bytes(b"%s %d %08x\n" % (manifest.MAGIC.encode(), manifest.VERSION,
                                                            crc32c(body)) + body)
    refused(tmp_path, lambda: k2(tmp_path), f"unreadable manifest: {why}", "--salvage would set aside q.manifest")


# ---------------------------------------------------------------------------------------------
# Kestrel 2


def test_size_field_damaged_to_a_huge_value_in_the_live_file_is_refused_not_cut(tmp_path: Path) -> None:
    coll = k2(tmp_path, max_memory_size=1 << 30)
    for i in range(1000):
        coll.put("q", [b"%04d" % i + ITEM])
    for _ in range(100):
        assert one(coll.remove("q")) is not None
    coll.close()
    live = tmp_path / "q"
    adds = [off for off, rec in read_journal(str(live)) if isinstance(rec, codec.AddX)]
    at = adds[len(adds) // 2]
    data = bytearray(live.read_bytes())
    data[at + 1:at + 5] = struct.pack("<i", 1 << 30)
    live.write_bytes(bytes(data))
    refused(tmp_path, lambda: k2(tmp_path, max_memory_size=1 << 30), str(live), f"offset {at}")


def _rotated_queue(path: Path, items: int = 300, removed: int = 50) -> QueueCollection:
    coll = k2(path)
    for i in range(items):
        coll.put("q", [b"%04d" % i + ITEM])
    for _ in range(removed):
        assert one(coll.remove("q")) is not None
    return coll


def test_a_deleted_middle_rotated_journal_is_refused_naming_it(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()
    files = rotated(tmp_path)
    assert len(files) >= 3
    middle = files[len(files) // 2]
    os.unlink(tmp_path / middle)
    refused(tmp_path, lambda: k2(tmp_path), str(tmp_path / middle), "missing")


def test_a_changed_byte_in_a_rotated_journal_is_refused(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()
    first = tmp_path / rotated(tmp_path)[0]
    at = next(off for off, rec in read_journal(str(first)) if isinstance(rec, codec.AddX))
    data = bytearray(first.read_bytes())
    data[at + 30] ^= 0x20  # inside an item's data: the records still read
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptJournalError) as err:
        k2(tmp_path)
    assert str(first) in str(err.value) and "CRC32C" in str(err.value)


def test_a_stray_older_pack_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    coll = _rotated_queue(tmp_path)
    old_state = (tmp_path / rotated(tmp_path)[0]).read_bytes() + codec.encode(codec.SaveXid(0))
    drain(coll, "q")
    for i in range(100):
        coll.put("q", [b"new%04d" % i])
    coll.close()
    stray = tmp_path / f"{rotated(tmp_path)[-1]}.pack"
    stray.write_bytes(old_state)
    refused(tmp_path, lambda: k2(tmp_path), str(stray), "pack")


def test_salvage_sets_a_stray_pack_aside_and_serves_the_queue(tmp_path: Path) -> None:
    coll = _rotated_queue(tmp_path)
    drain(coll, "q")
    coll.put("q", [b"last"])
    coll.close()
    stray = tmp_path / f"{rotated(tmp_path)[-1]}.pack"
    stray.write_bytes(codec.encode(codec.AddX(1, 0, b"stray")) + codec.encode(codec.SaveXid(0)))
    coll = k2(tmp_path, salvage=True)
    assert drain(coll, "q") == [b"last"]
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith(stray.name + ".corrupt-")]


def items_of(path: Path) -> list[bytes]:
    return [rec.data for _, rec in read_journal(str(path)) if isinstance(rec, codec.AddX)]


def test_salvage_after_a_missing_middle_journal_keeps_every_other_file(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()  # 300 adds, then 50 removes of the oldest
    files = rotated(tmp_path)
    lost = items_of(tmp_path / files[1])
    expected = [b"%04d" % i + ITEM for i in range(50, 300)]
    os.unlink(tmp_path / files[1])
    refused(tmp_path, lambda: k2(tmp_path), "missing", f"move nothing of {files[1]} (its records are lost)")
    coll = k2(tmp_path, salvage=True)
    assert drain(coll, "q") == [item for item in expected if item not in lost]
    coll.close()
    assert aside(tmp_path) == {}  # nothing else did not verify
    k2(tmp_path).close()  # the manifest now matches what was kept


@pytest.mark.parametrize("cut", [1, 30])
def test_salvage_after_a_sealed_journal_cut_short_keeps_its_whole_records_and_every_later_file(
        tmp_path: Path, cut: int) -> None:
    _rotated_queue(tmp_path).close()  # 300 adds, then 50 removes of the oldest
    ends_with_add = []
    for name in rotated(tmp_path):
        records = list(read_journal(str(tmp_path / name)))
        if isinstance(records[-1][1], codec.AddX) and records[-1][1].data[:4] >= b"0050":
            ends_with_add.append((name, records[-1]))
    name, (at, last) = ends_with_add[0]
    damaged = tmp_path / name
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[:-cut])  # its last record cut
    refused(tmp_path, lambda: k2(tmp_path), str(damaged), "cut short", "its whole records are kept",
            "and keep every other file")
    coll = k2(tmp_path, salvage=True)
    got = drain(coll, "q")
    coll.close()
    # Every item but the one cut, and none consumed back.
    assert got == [b"%04d" % i + ITEM for i in range(50, 300) if b"%04d" % i + ITEM != last.data]
    assert list(aside(tmp_path).values()) == [whole[at:len(whole) - cut]]


def test_the_refusal_names_what_salvage_would_set_aside_with_item_counts(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()
    files = rotated(tmp_path)
    second = tmp_path / files[1]
    count = len(items_of(second))
    data = bytearray(second.read_bytes())
    data[40] ^= 0x20  # inside an item's data: the records still read
    second.write_bytes(bytes(data))
    refused(tmp_path, lambda: k2(tmp_path), str(second), "CRC32C",
            f"--salvage would set aside {files[1]} ({count} items), and keep every other file")
    coll = k2(tmp_path, salvage=True)
    assert len(drain(coll, "q")) == 250 - count
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith(files[1] + ".corrupt-")]


def test_a_manifest_put_back_from_before_packs_is_set_aside_and_every_file_kept(tmp_path: Path) -> None:
    coll = k2(tmp_path, max_journal_size=8192)
    expected: list[bytes] = []
    for round_ in range(6):
        for i in range(60):
            coll.put("q", [b"%d-%04d" % (round_, i) + ITEM])
            expected.append(b"%d-%04d" % (round_, i) + ITEM)
        for _ in range(40):
            assert one(coll.remove("q")) == expected.pop(0) or True
        coll.queue("q").wait_for_packing()
        if round_ == 1:
            older = manifest_path(tmp_path).read_bytes()  # a backup taken then
    coll.close()
    manifest_path(tmp_path).write_bytes(older)  # put back after packs
    refused(tmp_path, lambda: k2(tmp_path, max_journal_size=8192), "older than the files",
            "--salvage would set aside q.manifest")
    coll = k2(tmp_path, salvage=True, max_journal_size=8192)
    assert drain(coll, "q") == expected  # every intact item, none withheld
    coll.close()
    k2(tmp_path, max_journal_size=8192).close()  # and the manifest written anew matches


def test_the_first_rotation_is_never_without_a_manifest(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    coll = k2(tmp_path)
    n = 0
    while not rotated(tmp_path):
        coll.put("q", [b"%04d" % n + ITEM])
        n += 1
    killed = tmp_path.parent / "killed"  # the queue path as a SIGKILL right after the rotation leaves it
    shutil.copytree(tmp_path, killed)
    assert manifest_path(killed).exists()
    stray = killed / f"q.{int(rotated(killed)[0][2:]) - 1}.pack"
    stray.write_bytes(codec.encode(codec.SaveXid(0)) * 2)
    capsys.readouterr()
    refused(killed, lambda: k2(killed), str(stray), "pack the manifest does not list")  # checks in force
    stray.unlink()
    again = k2(killed)
    assert len(drain(again, "q")) == n
    again.close()
    assert "NO MANIFEST" not in capsys.readouterr().out
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_stray_manifest_of_a_queue_with_no_file_is_set_aside_with_a_warning(
        tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    coll = k2(tmp_path) if fmt == "kestrel2" else k3(tmp_path)
    for i in range(300):
        coll.put("q", [b"%04d" % i + ITEM])
    coll.close()
    listed = manifest_path(tmp_path).read_bytes()
    for name in journal_files(tmp_path):
        os.unlink(tmp_path / name)
    manifest_path(tmp_path).write_bytes(listed)  # e.g. copied from elsewhere: no file of q is here
    capsys.readouterr()
    coll = k2(tmp_path) if fmt == "kestrel2" else k3(tmp_path)
    coll.put("q", [b"new"])  # the name is not blocked
    assert drain(coll, "q") == [b"new"]
    coll.close()
    assert "stray manifest" in capsys.readouterr().out
    assert [n for n in aside(tmp_path) if n.startswith("q.manifest.stray-")]


def test_a_directory_without_manifest_loads_with_a_warning_and_gets_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rotated_queue(tmp_path).close()
    os.unlink(manifest_path(tmp_path))
    coll = k2(tmp_path)
    assert len(drain(coll, "q")) == 250
    coll.close()
    assert capsys.readouterr().out.count("NO MANIFEST") == 1
    assert manifest.read(str(tmp_path), "q") is not None


def test_the_manifest_lists_every_rotated_journal_with_its_checksum(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and record.format == "kestrel2"
    assert sorted(record.files) == sorted(rotated(tmp_path))
    for name, entry in record.files.items():
        assert manifest.mismatch(str(tmp_path / name), entry) is None


def test_packs_keep_the_manifest_exact(tmp_path: Path) -> None:
    coll = k2(tmp_path, max_journal_size=8192)
    for round_ in range(5):
        for i in range(60):
            coll.put("q", [b"%d-%04d" % (round_, i) + ITEM])
        for _ in range(55):
            coll.remove("q")
        coll.queue("q").wait_for_packing()
    coll.close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == rotated(tmp_path)
    coll = k2(tmp_path, max_journal_size=8192)
    assert len(drain(coll, "q")) == 25
    coll.close()


def test_a_power_cut_after_a_rotated_journal_is_sealed_finds_it_where_the_manifest_lists_it(
        tmp_path: Path) -> None:
    """A seal makes the rotation's rename durable (its folder's fsync) before the manifest lists
    the rotated journal: the change after the rotation, whose new live journal's creation would have
    done it, need not come before a power cut (the start refused the queue, a listed file missing)."""
    configs = QueueConfigs({}, {"q": {"sync_journal": "always", "default_journal_size": 400, "max_memory_size": 600}})
    with Disk(tmp_path) as disk:
        coll = load_strictly(QueueCollection(str(tmp_path), configs, runtime=InlineRuntime()))
        items = [b"%d" % n + ITEM for n in range(9)]  # three to a journal
        for item in items:
            coll.put("q", [item])
        coll.queue("q").wait_for_packing()  # rotated by the last put, sealed: no change since
        record = manifest.read(str(tmp_path), "q")
        assert not (tmp_path / "q").exists() and record is not None and sorted(record.files) == rotated(tmp_path)
        disk.power_cut(str(tmp_path))
    coll = load_strictly(QueueCollection(str(tmp_path), configs, runtime=InlineRuntime()))
    assert drain(coll, "q") == items
    coll.close()


def test_a_rotation_cut_off_before_its_manifest_write_still_loads(tmp_path: Path) -> None:
    coll = _rotated_queue(tmp_path)
    coll.close()
    newest = rotated(tmp_path)[-1]
    record = manifest.read(str(tmp_path), "q")
    assert record is not None
    del record.files[newest]
    manifest.write(str(tmp_path), "q", record)
    coll = k2(tmp_path)
    assert len(drain(coll, "q")) == 250
    coll.close()


# A queue that empties once its live journal passes `default_journal_size` rotates and packs at
# once: the pack replaces the rotated journal, which is then neither fsynced nor sealed.
EMPTIED: dict[str, Any] = {"sync_journal": "never", "default_journal_size": 4096, "max_memory_size": 16384}


def _emptied_at_rotations(path: Path, rounds: int, sync: str = "never") -> QueueCollection:
    settings = {**EMPTIED, "sync_journal": sync}
    coll = load_strictly(QueueCollection(str(path), QueueConfigs({}, {"q": settings}), runtime=InlineRuntime()))
    for round_ in range(rounds):
        for i in range(30):
            coll.put("q", [b"%d-%04d" % (round_, i) + ITEM])
        assert len(coll.remove("q", 30)) == 30  # emptied past default_journal_size: rotated and packed
        coll.queue("q").wait_for_packing()
    return coll


@pytest.mark.parametrize("sync", ["never", "always"])
def test_a_rotated_journal_its_pack_replaces_is_neither_fsynced_nor_read_for_a_checksum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str) -> None:
    """Under `never`; under `always` a change being acknowledged waits for the rotated file's own
    fsync (closing the file unsynced failed it in the server and left the queue read-only), so the
    file is fsynced and sealed as any other."""
    touched: list[str] = []  # files of this queue path fsynced or sealed (another test's may be too)

    def note(path: str) -> None:
        if os.path.dirname(os.path.abspath(path)) == str(tmp_path):
            touched.append(os.path.basename(path))

    def noting(real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            note(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)
        return call

    real_seal = manifest.seal

    def seal(path: str, *args: Any, **kwargs: Any) -> manifest.Entry:
        note(path)
        return real_seal(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", noting(os.fsync))
    monkeypatch.setattr(os, "fdatasync", noting(os.fdatasync))
    monkeypatch.setattr(manifest, "seal", seal)
    coll = _emptied_at_rotations(tmp_path, 3, sync)
    packs = rotated(tmp_path)
    assert len(packs) == 1  # each pack replaced the journals before it
    rotated_touched = [name for name in touched if name.startswith("q.") and name[2:].isdigit()]
    assert bool(rotated_touched) == (sync == "always"), touched
    coll.close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == packs and record.files[packs[0]].pack
    coll = k2(tmp_path, **EMPTIED)
    assert drain(coll, "q") == []
    coll.close()


@pytest.mark.pure_build
def test_a_seal_that_finds_the_pack_put_in_place_over_its_journal_while_it_reads_is_done_not_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a sync policy the journal rotated for a pack taken at once is sealed as any other, and
    the pack, written meanwhile, does not wait for that seal: it may delete the journal and take its
    name while the seal reads it. The seal took the journal's size, then read the pack's fewer bytes
    under that name, and failed ("rotated journal file not sealed", an error logged for nothing);
    reading the pack whole, it listed the pack as that journal."""
    at_delete, opened = threading.Event(), threading.Event()
    journal: list[str] = []  # the journal the pack replaces and renames itself to
    real_seal, real_open, real_write = QueueJournal._seal_one, disk.open_file, manifest.write
    written: list[manifest.Entry] = []  # the journal's name in each manifest written

    def writing(queue_path: str, queue: str, record: manifest.Manifest) -> None:
        if journal and os.path.basename(journal[0]) in record.files:
            written.append(record.files[os.path.basename(journal[0])])
        real_write(queue_path, queue, record)

    def pack_waits(step: str) -> None:  # this queue's pack, its journals about to be deleted
        packs = [n for n in os.listdir(tmp_path) if n.startswith("q.") and n.endswith(".pack")]
        if step == "delete" and packs and not at_delete.is_set():
            journal.append(str(tmp_path / packs[0].removesuffix(".pack")))
            at_delete.set()
            assert opened.wait(10)

    def seal_once_the_pack_is_there(self: QueueJournal, path: str, *args: Any) -> None:
        if self.queue_path == str(tmp_path):
            assert at_delete.wait(10)
        real_seal(self, path, *args)

    def open_as_the_pack_takes_the_name(path: str, flags: int, mode: int = 0o644) -> int:
        if journal and path == journal[0] and not opened.is_set():
            opened.set()
            for _ in range(10_000):  # bounded: the pack renames itself to the journal's name
                if not os.path.exists(path + ".pack"):
                    break
                time.sleep(0.001)
        return real_open(path, flags, mode)

    monkeypatch.setattr(packer, "failpoint", pack_waits)
    monkeypatch.setattr(QueueJournal, "_seal_one", seal_once_the_pack_is_there)
    monkeypatch.setattr(disk, "open_file", open_as_the_pack_takes_the_name)
    monkeypatch.setattr(manifest, "write", writing)
    settings = {**EMPTIED, "sync_journal": "always"}
    coll = load_strictly(QueueCollection(str(tmp_path), QueueConfigs({}, {"q": settings}),
                                         runtime=ThreadsRuntime()))
    for i in range(30):
        coll.put("q", [b"%04d" % i + ITEM])
    # The queue's first manifest, begun on a thread of its own half way to the first rotation: a
    # rotation while it is still being written waits for a later change, and the remove below
    # would then rotate nothing and take no pack.
    coll.queue("q").wait_for_packing()
    with capture_logs() as logs:
        assert len(coll.remove("q", 30)) == 30  # emptied past default_journal_size: rotated and packed
        coll.queue("q").wait_for_packing()
    assert opened.is_set()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == []
    assert written and all(entry.pack for entry in written)  # listed at its name as the pack only
    (pack,) = rotated(tmp_path)
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == [pack] and record.files[pack].pack
    assert manifest.mismatch(str(tmp_path / pack), record.files[pack]) is None
    coll.close()
    coll = k2(tmp_path, **settings)
    assert drain(coll, "q") == []
    coll.close()


def test_a_rotated_journal_whose_pack_failed_is_sealed_after_all(tmp_path: Path) -> None:
    failed: list[str] = []

    def fail_once(step: str) -> None:
        if step == "write" and not failed:
            failed.append(step)
            raise OSError(28, "no space left (simulated)")

    packer.failpoint = fail_once
    try:
        coll = _emptied_at_rotations(tmp_path, 1)
    finally:
        packer.failpoint = None
    assert failed == ["write"]
    unpacked = rotated(tmp_path)
    assert len(unpacked) == 1 and not packer.is_our_pack(str(tmp_path / unpacked[0]))
    for i in range(80):  # past max_memory_size: a rotation sealed into the manifest as usual
        coll.put("q", [b"%04d" % i + ITEM])
    coll.close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == rotated(tmp_path) and len(record.files) == 2
    for name, entry in record.files.items():
        assert manifest.mismatch(str(tmp_path / name), entry) is None
    coll = k2(tmp_path, **EMPTIED)  # the first rotated journal is listed: not refused as a stray
    assert drain(coll, "q") == [b"%04d" % i + ITEM for i in range(80)]
    coll.close()


def test_a_crash_after_the_pack_is_listed_before_it_is_in_place_loads_the_unlisted_journal(
        tmp_path: Path) -> None:
    queues, crashed = tmp_path / "queues", tmp_path / "crashed"
    queues.mkdir()

    def crash(step: str) -> None:  # this queue's pack (another test's may run meanwhile), renamed next
        if step == "rename-pack" and not crashed.exists() and any(
                name.startswith("q") and filenames.is_temporary(name) for name in os.listdir(queues)):
            shutil.copytree(queues, crashed)  # the files a crash here would leave

    coll = load_strictly(QueueCollection(str(queues), QueueConfigs({}, {"q": EMPTIED}), runtime=InlineRuntime()))
    for i in range(30):
        coll.put("q", [b"%04d" % i + ITEM])
    assert len(coll.remove("q", 25)) == 25
    coll.put("q", [b"last"])
    packer.failpoint = crash
    try:
        assert len(coll.remove("q", 6)) == 6  # emptied: rotated, packed
        coll.queue("q").wait_for_packing()
    finally:
        packer.failpoint = None
    coll.close()
    record = manifest.read(str(crashed), "q")
    assert record is not None and record.files and all(entry.pack for entry in record.files.values())
    again = k2(crashed, **EMPTIED)  # the rotated journal, unlisted, is the pack's own: not a stray
    assert drain(again, "q") == []
    again.close()


def test_a_crash_after_the_pack_is_listed_loads_older_journals_it_replaces_not_yet_sealed(tmp_path: Path) -> None:
    """Rotated journals are sealed into the manifest in the background (an fsync, a checksum), and a
    pack lists itself without waiting for them: a crash before the pack is in place may find
    journals it replaces unlisted and older than the pack, rotations not yet recorded, not strays.
    (tests/storage/test_crash_points.py reaches this state through seals that lag; here the
    journals' entries are taken out of the crashed copy's manifest.)"""
    queues, crashed = tmp_path / "queues", tmp_path / "crashed"
    queues.mkdir()

    def crash(step: str) -> None:  # this queue's pack (another test's may run meanwhile), renamed next
        if step == "rename-pack" and not crashed.exists() and any(
                name.startswith("q") and filenames.is_temporary(name) for name in os.listdir(queues)):
            shutil.copytree(queues, crashed)

    settings = {**EMPTIED, "sync_journal": "always"}
    coll = load_strictly(QueueCollection(str(queues), QueueConfigs({}, {"q": settings}), runtime=InlineRuntime()))
    for i in range(100):  # past max_memory_size: rotated, not packed
        coll.put("q", [b"%04d" % i + ITEM])
    coll.queue("q").wait_for_packing()
    (older,) = rotated(queues)
    packer.failpoint = crash
    try:
        assert len(coll.remove("q", 100)) == 100  # emptied: rotated and packed, `older` replaced too
        coll.queue("q").wait_for_packing()
    finally:
        packer.failpoint = None
    coll.close()
    record = manifest.read(str(crashed), "q")
    newest = rotated(crashed)[-1]  # the journal rotated for the pack, of its timestamp
    assert record is not None and sorted(record.files) == [older, newest, f"{newest}.pack"]
    del record.files[older], record.files[newest]  # their seals had not run yet (in rotation order)
    manifest.write(str(crashed), "q", record)
    again = k2(crashed, **settings)
    assert drain(again, "q") == []
    again.close()


def _filled_then_emptied(queues: Path, settings: dict[str, Any]) -> tuple[QueueCollection, str, bytes]:
    """Queue `q` filled past its memory (a journal rotated, not packed), then emptied (rotated and
    packed, that older journal replaced too): the collection, the older journal's name and its bytes."""
    coll = load_strictly(QueueCollection(str(queues), QueueConfigs({}, {"q": settings}), runtime=InlineRuntime()))
    for i in range(100):
        coll.put("q", [b"%04d" % i + ITEM])
    coll.queue("q").wait_for_packing()
    (older,) = rotated(queues)
    backup = (queues / older).read_bytes()
    assert len(coll.remove("q", 100)) == 100
    coll.queue("q").wait_for_packing()
    return coll, older, backup


def test_an_older_copy_of_a_journal_a_pack_in_place_replaced_is_refused_not_replayed_before_it(
        tmp_path: Path) -> None:
    """A pack at its final name replaced every journal up to its own (they are deleted before its
    last rename): one found there unlisted is a stray, whose records replayed before the pack would
    bring its items back; salvage sets it aside."""
    settings = {**EMPTIED, "sync_journal": "always"}
    coll, older, backup = _filled_then_emptied(tmp_path, settings)
    coll.put("q", [b"after"])
    coll.close()
    assert older not in rotated(tmp_path) and int(older[2:]) < int(rotated(tmp_path)[0][2:])
    (tmp_path / older).write_bytes(backup)  # put back from a copy
    refused(tmp_path, lambda: k2(tmp_path, **settings), str(tmp_path / older), "older than the pack")
    coll = k2(tmp_path, salvage=True, **settings)
    assert drain(coll, "q") == [b"after"]
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith(older + ".")]


def _copied_before(queues: Path, crashed: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """`crashed` becomes a copy of `queues` as a kill just before this queue's journal first runs
    `method` (a QueueJournal method) would leave it."""
    real = getattr(QueueJournal, method)

    def copying(self: QueueJournal, *args: Any) -> Any:
        if self.queue_path == str(queues) and not crashed.exists():
            shutil.copytree(queues, crashed)
        return real(self, *args)

    monkeypatch.setattr(QueueJournal, method, copying)


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "unlisted"])
def test_a_journal_older_than_a_pack_at_its_final_name_not_yet_recorded_there_is_a_stray(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: bool) -> None:
    """Between a pack's final rename and the manifest write that records it there, the manifest
    still lists it as `q.<ts>.pack`; every journal at or before it was deleted before that rename,
    so one found there (an older copy put back, listed or not) is a stray, refused as elsewhere:
    replayed before the pack, it brought removed items back."""
    queues, crashed = tmp_path / "queues", tmp_path / "crashed"
    queues.mkdir()
    _copied_before(queues, crashed, monkeypatch, "_pack_finished")
    settings = {**EMPTIED, "sync_journal": "always"}
    coll, older, backup = _filled_then_emptied(queues, settings)
    coll.close()
    record = manifest.read(str(crashed), "q")
    (pack,) = rotated(crashed)
    assert record is not None and f"{pack}.pack" in record.files and older not in rotated(crashed)
    stray = older if listed else f"q.{int(older[2:]) - 1}"
    assert (stray in record.files) == listed
    (crashed / stray).write_bytes(backup)
    refused(crashed, lambda: k2(crashed, **settings), str(crashed / stray), pack)
    coll = k2(crashed, salvage=True, **settings)
    assert drain(coll, "q") == []
    coll.close()
    assert [n for n in aside(crashed) if n.startswith(stray + ".")]


def test_a_pack_that_fails_after_listing_itself_leaves_no_entry_to_mislead_a_later_start(tmp_path: Path) -> None:
    """A pack listed as `q.<ts>.pack` that then fails (a disk error before its rename) is taken out
    of the manifest when its failure is handled: left there, it outlived later packs, the next
    start said it was never put in place, and it made an older copy of the journal rotated at
    `<ts>`, put back after those packs, pass for that pack's own journal (replayed, its items back)."""
    failed: list[str] = []

    def fail_once(step: str) -> None:  # this queue's pack (another test's may run meanwhile)
        if step == "rename-pack" and not failed and any(
                name.startswith("q") and filenames.is_temporary(name) for name in os.listdir(tmp_path)):
            failed.append(step)
            raise OSError(5, "Input/output error (simulated)")

    coll = load_strictly(QueueCollection(str(tmp_path), QueueConfigs({}, {"q": EMPTIED}), runtime=InlineRuntime()))
    for i in range(30):
        coll.put("q", [b"%04d" % i + ITEM])
    packer.failpoint = fail_once
    try:
        assert len(coll.remove("q", 20)) == 20
        coll.queue("q").wait_for_packing()
        assert len(coll.remove("q", 10)) == 10  # emptied: rotated and packed, and the pack fails
        coll.queue("q").wait_for_packing()
    finally:
        packer.failpoint = None
    assert failed
    (journal,) = rotated(tmp_path)
    backup = (tmp_path / journal).read_bytes()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == [journal]  # sealed, and no pack entry left
    for round_ in range(2):  # later packs, in place: `journal` packed away
        for i in range(30):
            coll.put("q", [b"%d-%04d" % (round_, i) + ITEM])
        assert len(coll.remove("q", 30)) == 30
        coll.queue("q").wait_for_packing()
    coll.put("q", [b"last"])
    coll.close()
    assert journal not in rotated(tmp_path)
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == rotated(tmp_path)
    (tmp_path / journal).write_bytes(backup)  # an older copy put back
    refused(tmp_path, lambda: k2(tmp_path, **EMPTIED), str(tmp_path / journal), "older than the pack")


# ---------------------------------------------------------------------------------------------
# Kestrel 3


def k3(path: Path, salvage: bool = False, **settings: Any) -> QueueCollection:
    queues = {"q": {"journal_format": "kestrel3", **settings}}
    coll = QueueCollection(str(path), QueueConfigs({}, queues), clock=FakeClock(), salvage=salvage)
    return load_strictly(coll)  # a refused queue's CorruptJournalError, raised


def writers(path: Path) -> list[str]:
    return sorted((n for n in os.listdir(path) if n.startswith("q.") and n[2:].isdigit()),
                  key=lambda n: int(n[2:]))


def test_a_changed_byte_in_a_reader_checkpoint_is_refused_not_emptying_the_reader(tmp_path: Path) -> None:
    coll = k3(tmp_path)
    for i in range(800):
        coll.put("q", [b"%04d" % i])
    for _ in range(100):
        assert one(coll.remove("q")) is not None
    coll.close()
    checkpoint = tmp_path / "q.read."
    data = bytearray(checkpoint.read_bytes())
    data[42] ^= 0xFF  # inside a READ_HEAD's id
    checkpoint.write_bytes(bytes(data))
    refused(tmp_path, lambda: k3(tmp_path), str(checkpoint), "offset 36",  # no writer file deleted
            "--salvage would cut q.read. at offset 36", "served again")
    coll = k3(tmp_path, salvage=True)  # the reader is served again what it consumed after: no loss
    got = drain(coll, "q")
    assert got[-700:] == [b"%04d" % i for i in range(100, 800)]
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith("q.read..corrupt-")]


def test_a_deleted_fanout_checkpoint_is_refused_not_made_a_new_reader(tmp_path: Path) -> None:
    coll = k3(tmp_path)
    coll.queue("q+child")
    for i in range(900):
        coll.put("q", [b"%04d" % i])
    drain(coll, "q")
    coll.close()
    os.unlink(tmp_path / "q.read.child")
    refused(tmp_path, lambda: k3(tmp_path), str(tmp_path / "q.read.child"), "missing")
    coll = k3(tmp_path, salvage=True)
    assert drain(coll, "q+child") == [b"%04d" % i for i in range(900)]
    coll.close()


def test_a_deleted_middle_writer_file_is_refused_and_nothing_is_deleted(tmp_path: Path) -> None:
    coll = k3(tmp_path, default_journal_size=2000)
    for i in range(1000):
        coll.put("q", [b"%04d" % i])
    coll.close()
    files = writers(tmp_path)
    assert len(files) >= 3
    middle = files[len(files) // 2]
    os.unlink(tmp_path / middle)
    refused(tmp_path, lambda: k3(tmp_path, default_journal_size=2000), str(tmp_path / middle), "missing", "salvage")
    coll = k3(tmp_path, salvage=True, default_journal_size=2000)  # the advice holds: it loads the rest
    assert 0 < len(drain(coll, "q")) < 1000
    coll.close()
    k3(tmp_path, default_journal_size=2000).close()  # and the manifest now matches


def test_a_changed_sealed_writer_file_is_refused(tmp_path: Path) -> None:
    coll = k3(tmp_path, default_journal_size=2000)
    for i in range(1000):
        coll.put("q", [b"%04d" % i])
    coll.close()
    first = tmp_path / writers(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1  # an item's last data byte: the records still read
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptJournalError, match="CRC32C"):
        k3(tmp_path, default_journal_size=2000)


def test_kestrel3_consumed_files_deleted_and_manifest_kept_exact(tmp_path: Path) -> None:
    coll = k3(tmp_path, default_journal_size=2000)
    coll.queue("q+child")
    for i in range(1000):
        coll.put("q", [b"%04d" % i])
    drain(coll, "q")
    drain(coll, "q+child")
    coll.put("q", [b"last"])
    coll.close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and record.format == "kestrel3" and record.high_id == 1001
    assert sorted(n for n in record.files if n[2:].isdigit()) == writers(tmp_path)
    coll = k3(tmp_path, default_journal_size=2000)
    assert drain(coll, "q") == [b"last"] and drain(coll, "q+child") == [b"last"]
    coll.close()


def test_kestrel3_without_manifest_loads_with_a_warning(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    coll = k3(tmp_path)
    for i in range(10):
        coll.put("q", [b"%d" % i])
    coll.close()
    os.unlink(manifest_path(tmp_path))
    coll = k3(tmp_path)
    assert len(drain(coll, "q")) == 10
    coll.close()
    assert capsys.readouterr().out.count("NO MANIFEST") == 1
    assert manifest_path(tmp_path).exists()


def test_salvage_sets_an_unreadable_manifest_aside(tmp_path: Path) -> None:
    _rotated_queue(tmp_path).close()
    manifest_path(tmp_path).write_bytes(b"kestrel-manifest 1 00000000\n{}")
    with pytest.raises(CorruptJournalError):
        k2(tmp_path)
    coll = k2(tmp_path, salvage=True)
    assert len(drain(coll, "q")) == 250
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith("q.manifest.corrupt-")]
    assert manifest.read(str(tmp_path), "q") is not None


def test_kestrel3_record_damage_is_refused_naming_the_cut_and_salvage_keeps_what_precedes(
        tmp_path: Path) -> None:
    coll = k3(tmp_path)
    coll.put("q", [b"one"])
    coll.put("q", [b"two"])
    coll.close()
    (first,) = writers(tmp_path)
    second = 4 + 25 + 3  # the header, then the first PUT
    with open(tmp_path / first, "r+b") as f:
        f.seek(second)
        f.write(b"\xff")
    refused(tmp_path, lambda: k3(tmp_path), f"offset {second}", f"--salvage would cut {first} at offset {second}")
    coll = QueueCollection(str(tmp_path), QueueConfigs({}, {"q": {"journal_format": "kestrel3"}}))
    coll.load()  # the queue is refused; each request to it says what to do
    with pytest.raises(QueueDamaged, match="restart with --salvage: --salvage would cut"):
        coll.queue("q")
    coll.close()
    coll = k3(tmp_path, salvage=True)
    assert drain(coll, "q") == [b"one"]
    coll.close()
    assert [n for n in aside(tmp_path) if n.startswith(first + ".corrupt-")]


def test_the_converter_refuses_a_kestrel2_queue_that_does_not_match_its_manifest(tmp_path: Path) -> None:
    from kestrel.storage.tools import convert
    _rotated_queue(tmp_path).close()
    files = rotated(tmp_path)
    os.unlink(tmp_path / files[1])
    before = listing(tmp_path)
    with pytest.raises(CorruptJournalError, match="missing"):
        convert.convert(str(tmp_path), "kestrel3", ["q"])
    assert listing(tmp_path) == before


def test_the_converter_refuses_a_kestrel3_queue_missing_a_checkpoint(tmp_path: Path) -> None:
    from kestrel.storage.tools import convert
    coll = k3(tmp_path)
    coll.queue("q+child")
    for i in range(10):
        coll.put("q", [b"%d" % i])
    coll.close()
    os.unlink(tmp_path / "q.read.child")
    with pytest.raises(CorruptJournalError, match="missing"):
        convert.convert(str(tmp_path), "kestrel2", ["q"])
    assert manifest_path(tmp_path).exists()


def test_a_deleted_queue_leaves_no_manifest_and_a_queue_opened_later_keeps_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rotated_queue(tmp_path).close()
    capsys.readouterr()
    coll = QueueCollection(str(tmp_path), QueueConfigs({}, {"q": {"max_memory_size": 4096}}))
    q = coll.queue("q")  # opened by name, not by the start-up scan
    assert q.length == 250 and "NO MANIFEST" not in capsys.readouterr().out
    coll.delete("q")
    coll.close()
    assert not [n for n in journal_files(tmp_path) if n.startswith("q")]
    assert not manifest_path(tmp_path).exists()


def test_kestrel3_ids_keep_increasing_when_every_writer_file_but_an_empty_one_is_gone(tmp_path: Path) -> None:
    coll = k3(tmp_path, default_journal_size=200)
    for i in range(50):
        coll.put("q", [b"%04d" % i])
    drain(coll, "q")
    coll.close()
    for name in writers(tmp_path)[:-1]:  # as if every consumed file was deleted
        os.unlink(tmp_path / name)
    newest = tmp_path / writers(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:4])  # only the header
    record = manifest.read(str(tmp_path), "q")
    assert record is not None
    record.files = {n: e for n, e in record.files.items() if not n[2:].isdigit()}
    record.files[newest.name] = manifest.Entry()
    manifest.write(str(tmp_path), "q", record)
    coll = k3(tmp_path, default_journal_size=200)
    coll.put("q", [b"next"])
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.data == b"next" and item.xid > 50
    coll.close()


class Crash(BaseException):
    """The process stops here: nothing after it runs, nothing is closed."""


@pytest.mark.pure_build
@pytest.mark.parametrize("renamed", [False, True])
def test_a_checkpoint_rewrite_cut_off_on_either_side_of_its_rename_still_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renamed: bool) -> None:
    from kestrel.storage.kestrel3 import journal as k3_journal
    coll = k3(tmp_path)
    for i in range(40):
        coll.put("q", [b"%04d" % i])
    for _ in range(10):
        assert one(coll.remove("q")) is not None  # appended to the checkpoint
    real = k3_journal.write_checkpoint

    def crash(*args: Any, **kwargs: Any) -> str:
        if renamed:
            real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(k3_journal, "write_checkpoint", crash)
    with pytest.raises(Crash):
        coll.flush("q")  # the manifest lists the rewrite, then the process stops
    monkeypatch.undo()
    after = k3(tmp_path)  # no false refusal either way
    expected = [] if renamed else [b"%04d" % i for i in range(10, 40)]
    assert drain(after, "q") == expected
    after.close()
    assert drain(k3(tmp_path), "q") == []


def test_repeated_flushes_and_restarts_keep_checkpoints_matching_the_manifest(tmp_path: Path) -> None:
    for round_ in range(5):
        coll = k3(tmp_path)
        coll.queue("q+c")
        for i in range(20):
            coll.put("q", [b"%d.%d" % (round_, i)])
        assert one(coll.remove("q")) is not None
        coll.flush("q")
        coll.flush("q+c")
        coll.put("q", [b"kept"])
        coll.close()
    coll = k3(tmp_path)
    assert drain(coll, "q") == [b"kept"] and drain(coll, "q+c") == [b"kept"]
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_queue_deletion_cut_off_part_way_leaves_no_manifest_listing_its_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    coll = k3(tmp_path, default_journal_size=2000) if fmt == "kestrel3" else _rotated_queue(tmp_path)
    if fmt == "kestrel3":
        for i in range(300):
            coll.put("q", [b"%04d" % i])
    coll.queue("q").wait_for_packing()
    real = os.unlink
    calls = []

    def unlink_once(path: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        if len(calls) > 2:  # the manifest and one file are gone, then the process stops
            raise Crash
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_once)
    with pytest.raises(Crash):
        coll.delete("q")
    monkeypatch.undo()
    assert not manifest_path(tmp_path).exists()
    after = k3(tmp_path, default_journal_size=2000) if fmt == "kestrel3" else k2(tmp_path)
    after.close()  # what is left loads (as a queue without manifest), refused nowhere


def test_a_fanout_reader_deletion_cut_off_before_its_unlink_keeps_the_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = k3(tmp_path)
    coll.queue("q+child")
    for i in range(10):
        coll.put("q", [b"%d" % i])

    def crash(*_args: Any, **_kwargs: Any) -> None:
        raise Crash

    monkeypatch.setattr(os, "unlink", crash)
    with pytest.raises(Crash):
        coll.delete("q+child")
    monkeypatch.undo()
    after = k3(tmp_path)
    assert len(drain(after, "q+child")) == 10
    after.close()


def test_a_seal_that_fails_holds_back_the_newer_ones_so_the_next_start_refuses_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated journal whose seal fails (a disk error) stays unlisted: a newer one listed after it
    would make it an older journal missing from the manifest, a stray to the next start. Seals are
    held back behind it and tried again at the next rotation. The error names the rotated file."""
    real_seal, failed = manifest.seal, []

    def seal_failing_once(path: str, *args: Any, **kwargs: Any) -> manifest.Entry:
        if not failed:
            failed.append(os.path.basename(path))
            raise OSError(5, "Input/output error", path)
        return real_seal(path, *args, **kwargs)

    settings = {"max_journal_size": 8192}
    coll = k2(tmp_path, **settings)
    monkeypatch.setattr(manifest, "seal", seal_failing_once)
    with capture_logs() as logs:
        for i in range(120):  # in read-behind past max_memory_size: a rotation each 8 KB of journal
            coll.put("q", [b"%04d" % i + ITEM])
            coll.queue("q").wait_for_packing()
            if failed and len(rotated(tmp_path)) >= 3:
                break
    assert failed and len(rotated(tmp_path)) >= 3
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [os.path.basename(e["file"]) for e in errors] == failed, errors
    record = manifest.read(str(tmp_path), "q")  # the failed seal, tried again, listed it before the rest
    assert record is not None and sorted(record.files, key=lambda n: int(n[2:])) == rotated(tmp_path)
    coll.close()
    monkeypatch.undo()
    coll = k2(tmp_path, **settings)  # no journal refused as not listed
    assert drain(coll, "q") == [b"%04d" % i + ITEM for i in range(i + 1)]
    coll.close()
