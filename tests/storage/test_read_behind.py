"""Read-behind, rotation and packing: bounded memory, the seed's file layout, crashes while packing."""

from __future__ import annotations

import contextlib
import io
import os
import random
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import JournalReadError
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.tools.dump import dump_queue
from tests.support.descriptors import descriptors
from tests.support.queues import drain, one, reopen

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
        assert coll.put("q", [item(n)])
        peak = max(peak, q.memory_bytes)
    assert q.in_read_behind
    assert q.bytes >= 20 * BUDGET
    assert q.length == count
    got = []
    while (it := one(coll.remove("q"))) is not None:
        got.append(it.data)
        peak = max(peak, q.memory_bytes)
    assert got == [item(n) for n in range(count)]
    assert peak <= BUDGET + len(item(0))
    assert not q.in_read_behind


def test_read_behind_survives_restart_midway(tmp_path: Path) -> None:
    coll = make(tmp_path)
    count = 10 * BUDGET // len(item(0))
    coll.put("q", [item(n) for n in range(count)])
    taken = [one(coll.remove("q")).data for _ in range(count // 3)]  # type: ignore[union-attr]
    coll = reopen(coll)
    q = coll.queue("q")
    assert q.in_read_behind and q.memory_bytes <= BUDGET + len(item(0))
    rest = []
    while (it := one(coll.remove("q"))) is not None:
        rest.append(it.data)
    assert taken + rest == [item(n) for n in range(count)]


def test_rotation_and_packing_leave_the_seed_layout(tmp_path: Path) -> None:
    coll = make(tmp_path)
    q = coll.queue("q")
    count = 8 * BUDGET // len(item(0))
    for n in range(count):
        coll.put("q", [item(n)])
    rotated = [n for n in journal_names(tmp_path) if n.startswith("q.")]
    assert rotated, "read-behind rotates a new file every max_memory_size"
    assert all(n.split(".")[1].isdigit() for n in rotated)
    opened = one(coll.remove("q", transaction=True))
    assert opened is not None
    got = [opened.data]
    while (it := one(coll.remove("q"))) is not None:
        got.append(it.data)
        q.wait_for_packing()
    q.wait_for_packing()
    assert got == [item(n) for n in range(count)]
    names = journal_names(tmp_path)
    # The crashed collection's manifest writes still run in this process: only packs count here.
    assert not [n for n in names if n.endswith(".pack") or ("~~" in n and "~~manifest" not in n)]
    left = [n for n in names if n.startswith("q.")]
    assert len(left) == 1 and not set(left) & set(rotated)  # every rotated journal was packed away
    # The open read survives the packs and a restart, back at the head.
    coll = reopen(coll)
    again = one(coll.remove("q"))
    assert again is not None and again.data == item(0)
    assert one(coll.remove("q")) is None


def test_empty_queue_starts_a_fresh_journal_with_only_open_reads(tmp_path: Path) -> None:
    coll = make(tmp_path, max_memory_size=1 << 20)
    q = coll.queue("q")
    coll.put("q", [b"keep-open"])
    held = one(coll.remove("q", transaction=True))
    assert held is not None
    for n in range(60):
        coll.put("q", [item(n)])
        coll.remove("q")
        q.wait_for_packing()
    assert q.journal_size < 2048 + 200
    coll = reopen(coll)
    back = one(coll.remove("q"))
    assert back is not None and back.data == b"keep-open"
    assert one(coll.remove("q")) is None


def test_a_queue_emptied_into_a_large_batch_of_open_reads_packs_once_the_batch_is_confirmed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack taken while a consumer holds a large batch open (a Spark stream's, until its sink
    commits) would write every item of the batch again, just before the confirm closes it."""
    from kestrel.storage.kestrel2.queue import EMPTY_PACK_OPEN_READS

    written: list[int] = []
    real = packer.write_pack

    def counting(req: packer.PackRequest, *args: object, **kwargs: object) -> str:
        if req.queue_path == str(tmp_path):  # not another test's pack still being written
            written.append(len(req.open_reads))
        return real(req, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(packer, "write_pack", counting)
    coll = make(tmp_path, max_memory_size=1 << 24)
    q = coll.queue("q")
    batch = EMPTY_PACK_OPEN_READS + 1
    coll.put("q", [item(n) for n in range(batch)])
    held = coll.remove("q", batch, transaction=True)  # empties the queue, its journal past 2048 bytes
    q.wait_for_packing()
    assert len(held) == batch and written == []
    assert coll.confirm("q", [i.xid for i in held[:-1]]) == batch - 1  # one read left: packs now
    q.wait_for_packing()
    assert written == [1] and q.journal_size < 2048
    coll = reopen(coll)
    back = one(coll.remove("q"))
    assert back is not None and back.data == item(batch - 1)
    assert one(coll.remove("q")) is None


@pytest.mark.parametrize("step", ["write", "fsync", "rename-pack", "delete", "rename-final"])
def test_a_crash_at_each_step_of_packing_still_loads_correctly(tmp_path: Path, step: str) -> None:
    coll = make(tmp_path)
    q = coll.queue("q")
    count = 8 * BUDGET // len(item(0))
    for n in range(count):
        coll.put("q", [item(n)])
    opened = one(coll.remove("q", transaction=True))
    assert opened is not None
    crashed = []

    def crash(name: str) -> None:
        if name == step and not crashed:
            crashed.append(name)
            raise OSError(f"simulated crash at {name}")

    packer.failpoint = crash
    try:
        got = []
        while len(got) < count // 2 and (it := one(coll.remove("q"))) is not None:
            got.append(it.data)
            q.wait_for_packing()
    finally:
        packer.failpoint = None
    assert crashed == [step]
    # "Crash": drop the process state without closing, then load from the files as they are.
    again = QueueCollection(coll.path, coll.configs, clock=coll.clock)
    again.load()
    rest = []
    while (it := one(again.remove("q"))) is not None:
        rest.append(it.data)
    assert rest[0] == item(0)  # the read that was open comes back first
    assert rest[1:] == [item(n) for n in range(1 + len(got), count)]
    names = journal_names(tmp_path)
    # The crashed collection's manifest writes still run in this process: only packs count here.
    assert not [n for n in names if n.endswith(".pack") or ("~~" in n and "~~manifest" not in n)]


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
            assert coll.put("q", batch) == len(batch)
            model.extend(batch)
        elif roll < 0.7:
            it = one(coll.remove("q"))
            assert (it.data if it else None) == (model.pop(0) if model else None)
        elif roll < 0.85:
            it = one(coll.remove("q", transaction=True))
            expected = model.pop(0) if model else None
            assert (it.data if it else None) == expected
            if it is not None:
                opens[it.xid] = it.data
        elif roll < 0.93 and opens:
            xid = rnd.choice(sorted(opens))
            assert coll.confirm("q", [xid])
            del opens[xid]
        elif opens:
            xid = rnd.choice(sorted(opens))
            assert coll.unremove("q", [xid])
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
    while (it := one(coll.remove("q"))) is not None:
        got.append(it.data)
    assert got == model


def queue_disk_bytes(tmp_path: Path) -> int:
    return sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path) if n == "q" or n.startswith("q."))


def test_draining_a_backlog_of_100_times_the_budget_packs_passed_files_away(tmp_path: Path) -> None:
    """While the backlog drains, the files the cursor passed are packed: disk follows live data."""
    kb = 1024
    memory, default = 8 * kb, 8 * kb
    coll = make(tmp_path, max_memory_size=memory, max_journal_size=32 * kb, default_journal_size=default)
    q = coll.queue("q")
    count = 100 * memory // 256
    data = [b"%08d" % n + b"x" * 248 for n in range(count)]
    for n in range(0, count, 16):
        coll.put("q", data[n:n + 16])
    assert q.in_read_behind
    peak = queue_disk_bytes(tmp_path)
    record = len(codec.encode_addx(T0, 0, data[0]))
    held = [one(coll.remove("q", transaction=True)) for _ in range(3)]  # open reads stay open throughout
    open_record = len(codec.encode(codec.AddXid(1, T0, 0, data[0]))) + 5
    # Each item that left while the backlog drained costs an empty placeholder in the latest pack and
    # its one-byte REMOVE in the live journal, until the cursor reaches the live journal.
    per_departure = len(codec.encode_addx(T0, codec.PLACEHOLDER_EXPIRY, b"")) + len(codec.REMOVE_BYTES)
    got = [it.data for it in held if it is not None]
    samples = []
    while (it := one(coll.remove("q"))) is not None:
        got.append(it.data)
        if len(got) % 64 == 0:
            q.wait_for_packing()
            live = q.length * record + len(held) * open_record
            disk = queue_disk_bytes(tmp_path)
            samples.append((len(got), disk, live))
            slack = 2 * memory + default
            if q.in_read_behind:
                assert disk <= live + slack + per_departure * len(got), (len(got), disk, live)
            else:
                assert disk <= live + slack, (len(got), disk, live)
    assert got == data
    at_95 = next(disk for done, disk, _ in samples if done >= count * 95 // 100)
    assert at_95 < peak // 6, (at_95, peak)  # it used to hold nearly the whole peak until empty
    q.wait_for_packing()
    assert queue_disk_bytes(tmp_path) <= len(held) * open_record + 2 * memory + default
    coll = reopen(coll)
    back = [one(coll.remove("q")) for _ in range(4)]
    assert [b.data if b else None for b in back] == [h.data for h in held if h] + [None]


def test_packing_follows_the_cursor_again_after_a_restart_mid_drain(tmp_path: Path) -> None:
    kb = 1024
    memory = default = 8 * kb
    coll = make(tmp_path, max_memory_size=memory, max_journal_size=32 * kb, default_journal_size=default)
    count = 40 * memory // 256
    data = [b"%08d" % n + b"x" * 248 for n in range(count)]
    for n in range(0, count, 16):
        coll.put("q", data[n:n + 16])
    got = [one(coll.remove("q")).data for _ in range(count // 4)]  # type: ignore[union-attr]
    coll.queue("q").wait_for_packing()
    coll = reopen(coll)
    q = coll.queue("q")
    assert q.in_read_behind
    record = len(codec.encode_addx(T0, 0, data[0]))
    per_departure = len(codec.encode_addx(T0, codec.PLACEHOLDER_EXPIRY, b"")) + len(codec.REMOVE_BYTES)
    while (it := one(coll.remove("q"))) is not None:
        got.append(it.data)
        if len(got) % 64 == 0 and q.in_read_behind:
            q.wait_for_packing()
            disk, live = queue_disk_bytes(tmp_path), q.length * record
            assert disk <= live + 2 * memory + default + per_departure * len(got), (len(got), disk, live)
    assert got == data


def test_dump_prints_the_queue_a_start_up_would_load_and_changes_nothing(tmp_path: Path) -> None:
    coll = make(tmp_path)
    count = 4 * BUDGET // len(item(0))
    coll.put("q", [item(n) for n in range(count)])
    held = one(coll.remove("q", transaction=True))
    assert held is not None and one(coll.remove("q")) is not None
    coll.queue("q").wait_for_packing()
    before = {n: os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)}
    out = io.StringIO()
    assert dump_queue(str(tmp_path), "q", out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[1:3] == ["open", f"xid={held.xid}"] and lines[0].endswith(item(0).decode())
    assert [line.rsplit(":", 1)[1] for line in lines[1:-1]] == [item(n).decode() for n in range(2, count)]
    assert lines[-1] == f"q: 1 open reads, {count - 2} items"
    assert {n: os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)} == before


def test_a_put_that_catches_up_and_reads_behind_again_packs_nothing_it_does_not_hold(tmp_path: Path) -> None:
    """A batch whose discards bring the cursor to the journal's end (read-behind ends) and whose
    later items fill memory again (it starts again) in one change: the pack of what the backlog left
    behind is not taken then, since items are on disk only (it dropped the batch's last item)."""
    coll = make(tmp_path, max_memory_size=164, default_journal_size=400, max_items=6,
                discard_old_when_full=True)
    sizes = [3, 33, 60, 60, 0, 0, 34, 31]
    items = [b"%d." % n + b"x" * size for n, size in enumerate(sizes, 1)]
    coll.put("q", items[:4])
    coll.put("q", items[4:])  # discards 1 and 2: read-behind ends, then starts again at 8
    assert coll.queue("q").in_read_behind
    coll = reopen(coll)
    assert drain(coll, "q") == items[2:]


def open_in(path: Path) -> list[str]:
    """The files under `path` this process holds a descriptor of."""
    return sorted(os.path.basename(name) for name in descriptors(os.getpid()).values()
                  if name.startswith(str(path)))


@contextlib.contextmanager
def no_descriptor_left() -> Iterator[None]:
    """Every file descriptor of this process taken (its soft limit lowered to what it holds, then
    filled), as under a flood of clients; given back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_cursor_holds_a_descriptor_only_while_its_queue_is_read(tmp_path: Path, journal_format: str) -> None:
    """A queue in read-behind held its cursor's descriptor from the moment it entered read-behind to
    the end, beside its journal's: 10,000 queues paged out and left needed 20,000. The cursor opens
    its file with the next change and gives it back once the queue idles, keeping its place."""
    coll = make(tmp_path, journal_format=journal_format)
    items = [item(i) for i in range(200)]
    for n in range(0, 200, 4):
        assert coll.put("q", items[n:n + 4]) == 4
    q = coll.queue("q")
    assert q.in_read_behind
    got = [t.data for t in coll.remove("q", 1)]  # (each of the queue's files open)
    q.release_cursor()
    journal_only = len(open_in(tmp_path))  # (rotated files wait for their seal's fsync)
    assert journal_only, "the journal is open for writing"
    got += [t.data for t in coll.remove("q", 4)]
    assert len(open_in(tmp_path)) == journal_only + 1, "the change opened the cursor's file"
    q.release_cursor()
    assert len(open_in(tmp_path)) == journal_only and q.in_read_behind
    got += [t.data for t in coll.remove("q", 5)]
    assert len(open_in(tmp_path)) == journal_only + 1
    q.release_cursor()
    got += drain(coll, "q")
    assert got == items and not q.in_read_behind
    coll.close()
    assert open_in(tmp_path) == []


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_out_of_file_descriptors_a_change_of_a_queue_in_read_behind_is_refused_before_it_begins(
        tmp_path: Path, journal_format: str) -> None:
    """Entering read-behind opened a reader of the journal: with no descriptor left, the put (its
    items journaled) was answered with the error, its items stored all the same, so a retry stored
    them twice. Entering now opens nothing, so every put is stored once; the change that needs the
    cursor's file and cannot open it is refused before it begins, naming the queue and the cause,
    and the next one, a descriptor free again, reads on in order."""
    coll = make(tmp_path, max_memory_size=1_000, journal_format=journal_format)
    items = [item(i) for i in range(44)]
    for n in range(0, 40, 4):
        assert coll.put("q", items[n:n + 4]) == 4
    q = coll.queue("q")
    assert q.in_read_behind
    coll.remove("q", 1)  # the journal and the cursor's file open
    q.release_cursor()
    with no_descriptor_left():
        with pytest.raises(JournalReadError, match="cannot read the items of queue 'q' back .*Too many open files"):
            coll.remove("q", 20)
        assert q.length == 39 and q.in_read_behind
    assert coll.put("q", items[40:]) == 4
    assert drain(coll, "q") == items[1:]
    coll = reopen(coll)
    assert drain(coll, "q") == []
