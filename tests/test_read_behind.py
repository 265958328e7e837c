"""Read-behind, rotation and packing: bounded memory, the seed's file layout, crashes while packing."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from storage import QueueCollection, QueueConfigs, packer
from storage.clock import FakeClock
from tests.queues import reopen

T0 = 1_700_000_000_000
BUDGET = 4096  # max_memory_size for these tests


def make(tmp_path: Path, **settings: object) -> QueueCollection:
    base = {"max_memory_size": BUDGET, "default_journal_size": 2048}
    base.update(settings)
    coll = QueueCollection(str(tmp_path), QueueConfigs({}, {"q": base}), clock=FakeClock(T0))
    coll.load()
    return coll


def journal_names(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def item(n: int) -> bytes:
    return f"item-{n:06d}-".encode() + b"x" * 50


def test_queue_twenty_times_its_memory_budget_comes_back_in_order(tmp_path: Path) -> None:
    coll = make(tmp_path)
    q = coll.queue("q")
    count = (20 * BUDGET) // len(item(0)) + 1
    peak = 0
    for n in range(count):
        assert coll.add("q", item(n))
        peak = max(peak, q.memory_bytes)
    assert q.in_read_behind
    assert q.bytes >= 20 * BUDGET
    assert q.length == count
    got = []
    while (it := coll.remove("q")) is not None:
        got.append(it.data)
        peak = max(peak, q.memory_bytes)
    assert got == [item(n) for n in range(count)]
    assert peak <= BUDGET + len(item(0))
    assert not q.in_read_behind


def test_read_behind_survives_restart_midway(tmp_path: Path) -> None:
    coll = make(tmp_path)
    count = 10 * BUDGET // len(item(0))
    coll.add_many("q", [item(n) for n in range(count)])
    taken = [coll.remove("q").data for _ in range(count // 3)]  # type: ignore[union-attr]
    coll = reopen(coll)
    q = coll.queue("q")
    assert q.in_read_behind and q.memory_bytes <= BUDGET + len(item(0))
    rest = []
    while (it := coll.remove("q")) is not None:
        rest.append(it.data)
    assert taken + rest == [item(n) for n in range(count)]


def test_rotation_and_packing_leave_the_seed_layout(tmp_path: Path) -> None:
    coll = make(tmp_path)
    q = coll.queue("q")
    count = 8 * BUDGET // len(item(0))
    for n in range(count):
        coll.add("q", item(n))
    rotated = [n for n in journal_names(tmp_path) if n.startswith("q.")]
    assert rotated, "read-behind rotates a new file every max_memory_size"
    assert all(n.split(".")[1].isdigit() for n in rotated)
    opened = coll.remove("q", transaction=True)
    assert opened is not None
    got = [opened.data]
    while (it := coll.remove("q")) is not None:
        got.append(it.data)
        q.wait_for_packing()
    q.wait_for_packing()
    assert got == [item(n) for n in range(count)]
    names = journal_names(tmp_path)
    assert not [n for n in names if n.endswith(".pack") or "~~" in n]
    left = [n for n in names if n.startswith("q.")]
    assert len(left) == 1 and not set(left) & set(rotated)  # every rotated journal was packed away
    # The open read survives the packs and a restart, back at the head.
    coll = reopen(coll)
    again = coll.remove("q")
    assert again is not None and again.data == item(0)
    assert coll.remove("q") is None


def test_empty_queue_starts_a_fresh_journal_with_only_open_reads(tmp_path: Path) -> None:
    coll = make(tmp_path, max_memory_size=1 << 20)
    q = coll.queue("q")
    coll.add("q", b"keep-open")
    held = coll.remove("q", transaction=True)
    assert held is not None
    for n in range(60):
        coll.add("q", item(n))
        coll.remove("q")
        q.wait_for_packing()
    assert q.journal_size < 2048 + 200
    coll = reopen(coll)
    back = coll.remove("q")
    assert back is not None and back.data == b"keep-open"
    assert coll.remove("q") is None


@pytest.mark.parametrize("step", ["write", "fsync", "rename-pack", "delete", "rename-final"])
def test_a_crash_at_each_step_of_packing_still_loads_correctly(tmp_path: Path, step: str) -> None:
    coll = make(tmp_path)
    q = coll.queue("q")
    count = 8 * BUDGET // len(item(0))
    for n in range(count):
        coll.add("q", item(n))
    opened = coll.remove("q", transaction=True)
    assert opened is not None
    crashed = []

    def crash(name: str) -> None:
        if name == step and not crashed:
            crashed.append(name)
            raise OSError(f"simulated crash at {name}")

    packer.failpoint = crash
    try:
        got = []
        while len(got) < count // 2 and (it := coll.remove("q")) is not None:
            got.append(it.data)
            q.wait_for_packing()
    finally:
        packer.failpoint = None
    assert crashed == [step]
    # "Crash": drop the process state without closing, then load from the files as they are.
    again = QueueCollection(coll.path, coll.configs, clock=coll.clock)
    again.load()
    rest = []
    while (it := again.remove("q")) is not None:
        rest.append(it.data)
    assert rest[0] == item(0)  # the read that was open comes back first
    assert rest[1:] == [item(n) for n in range(1 + len(got), count)]
    names = journal_names(tmp_path)
    assert not [n for n in names if n.endswith(".pack") or "~~" in n]


def test_random_reads_and_aborts_through_read_behind_and_restarts(tmp_path: Path) -> None:
    """A model check over many rotations and packs, with restarts in between."""
    rnd = random.Random(7)
    coll = make(tmp_path)
    model: list[bytes] = []
    opens: dict[int, bytes] = {}
    n = 0
    for step in range(1500):
        roll = rnd.random()
        if roll < 0.5:
            batch = [item(n + i) for i in range(rnd.randint(1, 5))]
            n += len(batch)
            assert coll.add_many("q", batch) == len(batch)
            model.extend(batch)
        elif roll < 0.7:
            it = coll.remove("q")
            assert (it.data if it else None) == (model.pop(0) if model else None)
        elif roll < 0.85:
            it = coll.remove("q", transaction=True)
            expected = model.pop(0) if model else None
            assert (it.data if it else None) == expected
            if it is not None:
                opens[it.xid] = it.data
        elif roll < 0.93 and opens:
            xid = rnd.choice(sorted(opens))
            assert coll.confirm("q", xid)
            del opens[xid]
        elif opens:
            xid = rnd.choice(sorted(opens))
            assert coll.unremove("q", xid)
            model.insert(0, opens.pop(xid))
        if step % 300 == 299:
            coll.queue("q").wait_for_packing()
            coll = reopen(coll)
            # open reads come back to the head, lowest xid first
            model = [opens[x] for x in sorted(opens)] + model
            opens.clear()
        q = coll.queue("q")
        assert q.length == len(model)
    got = []
    while (it := coll.remove("q")) is not None:
        got.append(it.data)
    assert got == model
