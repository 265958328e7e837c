"""What creates a queue, and what a created queue leaves on disk (as Kestrel's QueueCollection)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection
from tests.support.queues import open_collection, reopen

FORMATS = ["kestrel2", "kestrel3"]


def _collection(path: Path, fmt: str) -> QueueCollection:
    return open_collection(path, {"journal_format": fmt})


@pytest.mark.parametrize("fmt", FORMATS)
def test_operations_that_only_read_or_destroy_create_no_queue(tmp_path: Path, fmt: str) -> None:
    coll = _collection(tmp_path, fmt)
    coll.flush("ghost")
    coll.flush_all()
    coll.delete("ghost")
    assert not coll.confirm("ghost", 1) and not coll.unremove("ghost", 1)
    assert coll.confirm_many("ghost", [1]) == 0 and coll.unremove_many("ghost", [1]) == 0
    assert coll.get("ghost") is None and coll.queue_names() == [] and coll.queue_creates == 0
    assert os.listdir(tmp_path) == []
    coll.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_created_and_left_empty_survives_a_restart(tmp_path: Path, fmt: str) -> None:
    coll = _collection(tmp_path, fmt)
    coll.queue("empty")
    assert os.listdir(tmp_path)  # its journal file exists at once, as Kestrel's setup creates it
    again = reopen(coll)
    assert again.queue_names() == ["empty"] and again.get("empty") is not None
    again.close()


def test_a_fanout_child_created_and_left_empty_survives_a_restart(tmp_path: Path) -> None:
    coll = _collection(tmp_path, "kestrel2")
    coll.queue("jobs+audit")
    again = reopen(coll)
    assert again.queue_names() == ["jobs", "jobs+audit"]
    again.close()
