"""The suite closes the collections a test's helper `opened` and the test left open, once the test
has run (tests/support/queues.py, called by tests/conftest.py), and only those."""

from __future__ import annotations

import os
from pathlib import Path

from kestrel.storage import QueueCollection
from tests.support.descriptors import descriptors
from tests.support.queues import close_left_open, open_collection, opened, reopen


def journal_descriptors(path: Path) -> list[str]:
    """This process's descriptors naming a file under `path`."""
    return [name for name in descriptors(os.getpid()).values() if name.startswith(str(path))]


def test_a_collection_opened_and_left_open_is_closed_with_its_journals(tmp_path: Path) -> None:
    coll = opened(QueueCollection(str(tmp_path / "left")))
    coll.load()
    coll.put("q", [b"item"])
    assert journal_descriptors(tmp_path / "left")
    close_left_open()
    assert coll.closed and not journal_descriptors(tmp_path / "left")


def test_a_reopened_collection_is_opened_as_the_one_it_replaced(tmp_path: Path) -> None:
    kept = reopen(opened(QueueCollection(str(tmp_path / "kept"))))
    left = reopen(open_collection(tmp_path / "left"))  # a test's own, which may "crash" it
    close_left_open()
    assert kept.closed and not left.closed
    left.close()

