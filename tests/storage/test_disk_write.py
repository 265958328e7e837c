"""A journal append's write: the C helper (src/kestrel/storage/_disk.c), which keeps the
interpreter's lock through the system call, answers as `os.write`, its twin, does."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kestrel.storage import disk

try:
    from kestrel.storage._disk import write as c_write
except ImportError:  # built without a C compiler
    c_write = None

Write = Callable[[int, bytes | memoryview], int]
WRITES = [pytest.param(os.write, id="os")] + ([] if c_write is None else [pytest.param(c_write, id="c")])


def test_the_journal_appends_write_through_the_helper_where_the_build_has_it() -> None:
    assert disk.write is (os.write if c_write is None else c_write)


@pytest.mark.parametrize("write", WRITES)
def test_each_kind_of_bytes_lands_whole_after_what_was_there(tmp_path: Path, write: Write) -> None:
    path = tmp_path / "journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        pieces = [b"first", memoryview(b"--second--")[2:-2], bytes(bytearray(b"third")), b""]
        assert [write(fd, piece) for piece in pieces] == [5, 6, 5, 0]
    finally:
        os.close(fd)
    assert path.read_bytes() == b"firstsecondthird"


@pytest.mark.parametrize("write", WRITES)
def test_a_failed_write_raises_the_oserror_of_its_errno(tmp_path: Path, write: Write) -> None:
    reading = os.open(tmp_path / "r", os.O_RDONLY | os.O_CREAT, 0o644)
    os.close(reading)
    with pytest.raises(OSError) as raised:
        write(reading, b"data")  # closed
    assert raised.value.errno == errno.EBADF
    reading = os.open(tmp_path / "r", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as raised:
            write(reading, b"data")  # not open for writing
        assert raised.value.errno == errno.EBADF
    finally:
        os.close(reading)
    if os.path.exists("/dev/full"):
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            with pytest.raises(OSError) as raised:
                write(full, b"data")
            assert raised.value.errno == errno.ENOSPC
        finally:
            os.close(full)


@pytest.mark.parametrize("write", WRITES)
def test_what_is_not_a_descriptor_or_bytes_is_refused_by_name(write: Write) -> None:
    with pytest.raises(TypeError):
        write("3", b"data")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        write(1, "data")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        write(1 << 40, b"data")
