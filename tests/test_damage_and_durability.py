"""Damaged journals (torn tail, corrupt middle, salvage) and SIGKILL with sync_journal: always."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage import QueueCollection, QueueConfigs
from storage.codec import AddX, RemoveTentativeXid, Unremove, encode
from storage.errors import CorruptJournalError
from tests.queues import drain

T0 = 1_700_000_000_000


def addx(data: bytes) -> bytes:
    return encode(AddX(T0, 0, data))


@pytest.mark.parametrize("cut", [1, 3, 10, 20])
def test_torn_tail_is_cut_keeping_a_copy_and_complete_records_kept(tmp_path: Path, cut: int,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    good = addx(b"one") + addx(b"two") + encode(RemoveTentativeXid(1))
    torn = addx(b"three-is-longer")[:cut]
    (tmp_path / "q").write_bytes(good + torn)
    coll = QueueCollection(str(tmp_path))
    coll.load()
    # Cut exactly at the torn record; then the open read is journaled back to the head.
    assert (tmp_path / "q").read_bytes() == good + encode(Unremove(1))
    copies = [n for n in os.listdir(tmp_path) if n.startswith("q.torn-")]
    assert len(copies) == 1 and (tmp_path / copies[0]).read_bytes() == torn
    assert drain(coll, "q") == [b"one", b"two"]
    coll.add("q", b"after")
    coll.close()
    logged = capsys.readouterr().out
    assert "torn record" in logged and str(len(good)) in logged and str(tmp_path / "q") in logged
    again = QueueCollection(str(tmp_path))
    again.load()
    assert drain(again, "q") == [b"after"]


def test_corrupt_middle_refuses_to_load_naming_file_offset_and_opcode(tmp_path: Path) -> None:
    first = addx(b"one")
    bad = bytes([0x42]) + b"\x00" * 8
    (tmp_path / "q").write_bytes(first + bad + addx(b"two"))
    coll = QueueCollection(str(tmp_path))
    with pytest.raises(CorruptJournalError) as err:
        coll.load()
    message = str(err.value)
    assert str(tmp_path / "q") in message and f"offset {len(first)}" in message and "opcode 66" in message
    assert (tmp_path / "q").read_bytes() == first + bad + addx(b"two")  # nothing changed on disk


def test_salvage_keeps_what_precedes_the_damage_and_a_copy_of_what_it_cuts(tmp_path: Path) -> None:
    first = addx(b"one") + addx(b"two")
    content = first + bytes([0x42]) + addx(b"lost")
    (tmp_path / "q").write_bytes(content)
    coll = QueueCollection(str(tmp_path), salvage=True)
    coll.load()
    assert drain(coll, "q") == [b"one", b"two"]
    copies = [n for n in os.listdir(tmp_path) if ".corrupt-" in n]
    assert len(copies) == 1
    assert (tmp_path / "q").read_bytes()[:len(first)] + (tmp_path / copies[0]).read_bytes() == content
    coll.close()
    again = QueueCollection(str(tmp_path))  # loads cleanly afterwards, without salvage
    again.load()
    assert drain(again, "q") == []


def test_incomplete_record_before_a_later_file_is_corruption(tmp_path: Path) -> None:
    (tmp_path / "q.100").write_bytes(addx(b"a") + addx(b"b")[:5])
    (tmp_path / "q").write_bytes(addx(b"c"))
    with pytest.raises(CorruptJournalError, match="incomplete record"):
        QueueCollection(str(tmp_path)).load()


WRITER = textwrap.dedent("""
    import sys
    from storage import QueueCollection, QueueConfigs
    coll = QueueCollection(sys.argv[1], QueueConfigs({"sync_journal": "always"}))
    coll.load()
    n = 0
    while True:
        batch = [b"item-%d" % (n + i) for i in range(int(sys.argv[2]))]
        coll.add_many("durable", batch)
        n += len(batch)
        print(n, flush=True)   # acknowledged: everything up to n is on disk
""")


@pytest.mark.parametrize("batch", [1, 7])
def test_sigkill_loses_no_acknowledged_item(tmp_path: Path, batch: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(batch)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    acknowledged = 0
    for line in proc.stdout:
        if not line.strip().isdigit():
            continue  # a log line
        acknowledged = int(line)
        if acknowledged >= 200:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}))
    coll.load()
    got = drain(coll, "durable")
    assert len(got) >= acknowledged
    assert got == [b"item-%d" % i for i in range(len(got))]
