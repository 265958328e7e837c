"""The power cut the durability tests cut with (`tests/support/power_loss.py`): a file keeps what an
fsync of it covered, a folder the names its last fsync saw."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kestrel.storage import disk as kdisk
from tests.support.power_loss import Disk


def fsynced(path: Path, data: bytes) -> None:
    """Write `path` whole and fsync it (not its folder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def tree(path: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `path`, by relative path."""
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def test_a_name_made_since_its_folder_s_fsync_is_lost_with_what_its_file_s_fsync_covered(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"there before")  # what the Disk finds is durable
    with Disk(tmp_path) as disk:
        fsynced(tmp_path / "new", b"fsynced, its name not")
        (tmp_path / "folder").mkdir()
        disk.power_cut(str(tmp_path))
    assert tree(tmp_path) == {"old": b"there before"}


def test_a_file_keeps_what_its_fsync_covered_and_the_torn_prefix_asked_for(tmp_path: Path) -> None:
    with Disk(tmp_path) as disk:
        fsynced(tmp_path / "f", b"covered")
        kdisk.fsync_path(str(tmp_path))
        with open(tmp_path / "f", "ab") as f:
            f.write(b"-written after")
        disk.power_cut(str(tmp_path), keep=3)
    assert tree(tmp_path) == {"f": b"covered-wr"}


def test_names_taken_out_since_come_back_with_their_files_durable_bytes(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    with Disk(tmp_path) as disk:
        fsynced(tmp_path / "sub" / "a", b"a's")
        fsynced(tmp_path / "b", b"b's")
        kdisk.fsync_path(str(tmp_path / "sub"))
        kdisk.fsync_path(str(tmp_path))
        os.rename(tmp_path / "sub" / "a", tmp_path / "sub" / "renamed")
        kdisk.replace_file(str(tmp_path / "c"), b"replaced whole", str(tmp_path / "c~~"))  # durable
        os.unlink(tmp_path / "b")
        left = tmp_path.parent / "left"
        disk.left_by_cut(str(tmp_path), str(left))  # a copy: the tree is as it was
        assert tree(tmp_path) == {"c": b"replaced whole", "sub": None, "sub/renamed": b"a's"}
        disk.power_cut(str(tmp_path))
    assert tree(tmp_path) == tree(left) == {"b": b"b's", "c": b"replaced whole", "sub": None, "sub/a": b"a's"}


def test_a_folder_removed_since_its_parent_s_fsync_comes_back_as_its_own_fsync_saw_it(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    with Disk(tmp_path) as disk:
        fsynced(tmp_path / "sub" / "kept", b"k")
        kdisk.fsync_path(str(tmp_path / "sub"))
        (tmp_path / "sub" / "kept").unlink()
        (tmp_path / "sub").rmdir()
        disk.power_cut(str(tmp_path))
    assert tree(tmp_path) == {"sub": None, "sub/kept": b"k"}


def test_a_file_renamed_while_its_folder_is_listed_for_an_fsync_is_kept_under_one_of_its_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotation renames a journal on one thread while another fsyncs the folder: the listing,
    which reads the names and then opens each, must not see the file under neither name."""
    (tmp_path / "q0").write_bytes(b"the journal")
    with Disk(tmp_path) as disk:
        names_read, renamed = threading.Event(), threading.Event()
        hold = disk._hold

        def held_after_a_pause(path: str, folder: int | None = None) -> tuple[int, bool] | None:
            names_read.set()
            renamed.wait(0.5)  # time for the rename to go in between, unless the Disk keeps it out
            return hold(path, folder)

        monkeypatch.setattr(disk, "_hold", held_after_a_pause)

        def rotate() -> None:
            names_read.wait()
            os.rename(tmp_path / "q0", tmp_path / "q0.1")
            renamed.set()

        rotation = threading.Thread(target=rotate)
        rotation.start()
        kdisk.fsync_path(str(tmp_path))
        rotation.join()
        monkeypatch.undo()
        disk.power_cut(str(tmp_path))
    assert tree(tmp_path) in ({"q0": b"the journal"}, {"q0.1": b"the journal"})


def test_only_a_root_can_be_cut(tmp_path: Path) -> None:
    with Disk(tmp_path) as disk, pytest.raises(ValueError, match="not a root"):
        disk.power_cut(str(tmp_path.parent))
