"""The codec against the journal format document itself, and the dump tool."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from storage import codec
from storage.dump import dump

SEED = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "kestrel-journal-format.md"


@pytest.mark.skipif(not SEED.exists(), reason=f"the format document is not at {SEED}")
def test_every_documented_opcode_has_its_number() -> None:
    documented = dict(re.findall(r"^- ([A-Z_]+) \((\d+)\)", SEED.read_text(), re.MULTILINE))
    assert len(documented) == 9
    for name, number in documented.items():
        assert getattr(codec, name) == int(number), name


def test_dump_prints_records_and_reports_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "q"
    path.write_bytes(codec.encode_addx(1, 0, b"hi") + codec.encode_xid(codec.REMOVE_TENTATIVE_XID, 1)
                     + b"\x02\x10")
    out = io.StringIO()
    assert dump(str(path), out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["0", "addx(2:0:hi)"]
    assert lines[1].split() == ["23", "remove-tentative(1)"]
    assert lines[2].split()[:3] == ["28", "torn:", "2"]


def test_dump_tells_a_damaged_size_field_from_a_torn_tail(tmp_path: Path) -> None:
    records = [codec.encode_addx(1, 0, b"item-%d" % n) for n in range(5)]
    damaged = bytearray(b"".join(records))
    damaged[len(records[0]) + 3] ^= 0x01  # bit 16 of the second record's size field
    path = tmp_path / "q"
    path.write_bytes(bytes(damaged))
    out = io.StringIO()
    assert dump(str(path), out) == 1
    reported = next(line for line in out.getvalue().splitlines() if "corrupt:" in line).split()
    assert reported[:2] == [str(len(records[0])), "corrupt:"] and "size field" in out.getvalue()
