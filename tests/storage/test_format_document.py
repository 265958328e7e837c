"""The codec against the journal format document itself, and the dump tool."""

from __future__ import annotations

import io
import re
import struct
from pathlib import Path

import pytest

from kestrel.storage.kestrel2 import codec
from kestrel.storage.tools.dump import dump
from tests.conftest import ROOT

SEED = ROOT.parent / "shared" / "seeds" / "kestrel-journal-format.md"


@pytest.mark.skipif(not SEED.exists(), reason=f"the format document is not at {SEED}")
def test_every_documented_opcode_has_its_number() -> None:
    documented = dict(re.findall(r"^- ([A-Z_]+) \((\d+)\)", SEED.read_text(), re.MULTILINE))
    assert len(documented) == 9
    for name, number in documented.items():
        assert getattr(codec, name) == int(number), name


# The values each documented field takes in the layout test, by the words the document uses.
T0 = 1_700_000_000_000
FIELD_VALUES = {"xid": 7, "expiration time (absolute, epoch time, in seconds)": 1_700_000_123,
                "add time (absolute, epoch time, in milliseconds)": T0,
                "expiration time (absolute, epoch time, in milliseconds)": T0 + 5_000,
                "number of open transactions to follow as ADD_XID": 0}
DATA = b"hi"
# The codec's record for each documented opcode, built from the same values.
RECORDS = {
    "ADD": codec.Add(1_700_000_123, DATA),
    "REMOVE": codec.Remove(),
    "ADDX": codec.AddX(T0, T0 + 5_000, DATA),
    "REMOVE_TENTATIVE": codec.RemoveTentative(),
    "SAVE_XID": codec.SaveXid(7),
    "UNREMOVE": codec.Unremove(7),
    "CONFIRM_REMOVE": codec.ConfirmRemove(7),
    "ADD_XID": codec.AddXid(7, T0, T0 + 5_000, DATA),
    "STATE_DUMP": codec.StateDump(7, 0),
}


def documented_layouts() -> dict[str, bytes]:
    """Each opcode's bytes, built field by field from the document's own layout (little-endian)."""
    layouts: dict[str, bytes] = {}
    for name, number, body in re.findall(r"^- ([A-Z_]+) \((\d+)\)\n((?:\n| {8}.*\n)*)", SEED.read_text(),
                                         re.MULTILINE):
        fields = [line.strip() for line in body.splitlines() if line.strip()]
        out = bytes([int(number)])
        for field in fields:
            kind, _, meaning = field.partition(" ")
            if kind == "binary":
                out += DATA
            elif meaning == "size":
                overhead = int(re.findall(r"size - (\d+)", body)[0])  # the data is `size - overhead`
                out += struct.pack("<i", len(DATA) + overhead)
            else:
                out += struct.pack({"i32": "<i", "i64": "<q"}[kind], FIELD_VALUES[meaning])
        layouts[name] = out
    return layouts


@pytest.mark.skipif(not SEED.exists(), reason=f"the format document is not at {SEED}")
def test_each_opcode_encodes_and_decodes_as_the_document_lays_it_out() -> None:
    layouts = documented_layouts()
    assert sorted(layouts) == sorted(RECORDS)
    for name, laid_out in layouts.items():
        assert codec.encode(RECORDS[name]) == laid_out, name
        assert codec.decode(laid_out, 0, True) == (RECORDS[name], len(laid_out)), name


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
