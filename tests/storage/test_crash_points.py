"""A SIGKILL at every step of rotations, packs, checkpoint rewrites and deletions, in both formats,
also after a disk error at one step of a Kestrel 2 rotation, pack or seal, and a power cut at every
step of those under `always` (with and without the commit log) and under a periodic sync: each
start-up refuses nothing, and the queue holds every acknowledged (or synced) item once and none
whose removal was acknowledged (`tests/support/crash_points.py` copies the queue path, or what a
power cut would leave of it, before each change of a name and each fsync; each copy is started on
without salvage); and one refuses an older copy of a journal put beside a pack that replaced it, at
every step."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import QueueCollection, QueueConfigs, manifest
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.kestrel2 import packer
from kestrel.storage.kestrel2.journal import QueueJournal
from tests.support.crash_points import Crash, CrashPoints, InlineRuntime, skip_fsync
from tests.support.power_loss import Disk
from tests.support.queues import drain, load_strictly

Outcomes = dict[str, tuple[list[bytes], ...]]  # by queue: what a start there may find, each a whole queue


class Model:
    """What each queue holds as acknowledged, and what the change under way would make it."""

    def __init__(self, queues: list[str]) -> None:
        self.held: dict[str, list[bytes]] = {q: [] for q in queues}  # open reads: back first at a start
        self.items: dict[str, list[bytes]] = {q: [] for q in queues}
        self._after: dict[str, list[bytes]] | None = None
        self._between: list[dict[str, list[bytes]]] = []  # what a batch of changes passes through
        self._unsure: str | None = None  # a queue being created or deleted

    def note(self) -> Outcomes:
        """What a kill now may leave: the state before the change under way, or after it; of a queue
        being created or deleted, anything or nothing (no outcome); and no other queue."""
        out: Outcomes = {}
        for queue, items in self.items.items():
            states = [items] if self._after is None else [items, self._after.get(queue, items)]
            states += [between.get(queue, items) for between in self._between]
            out[queue] = tuple(self.held[queue] + state for state in states)
        if self._unsure is not None:
            out[self._unsure] = ()
        return out

    def create(self, queue: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)`, which makes `queue`, empty."""
        self._unsure = queue
        try:
            fn(*args)
        finally:
            self._unsure = None
            self.items[queue], self.held[queue] = [], []

    def delete(self, queue: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)`, which deletes `queue`."""
        del self.items[queue], self.held[queue]
        self._unsure = queue
        try:
            fn(*args)
        finally:
            self._unsure = None

    def change(self, after: dict[str, list[bytes]], fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)`, a change that makes the queues of `after` hold what it says."""
        self._after = after
        try:
            return fn(*args)
        finally:
            self._after = None
            self.items.update(after)

    def batch(self, steps: list[dict[str, list[bytes]]], fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)`, changes each making the queues of a step hold what it says, the last
        step what they hold after: a kill meanwhile may leave any step."""
        self._between = steps[:-1]
        try:
            return self.change(steps[-1], fn, *args)
        finally:
            self._between = []


def settle(coll: QueueCollection, *queues: str) -> None:
    """Let the background work run to its end: rotated files sealed, packs written."""
    for queue in queues:
        coll.queue(queue).wait_for_packing()
    gevent.sleep(0)


def check(crashes: list[Crash], configs: QueueConfigs, steps: tuple[str, ...]) -> None:
    """Start on every copy: none refused, each queue as one of the outcomes noted for it."""
    taken = sorted({c.step for c in crashes})
    assert all(any(step in s for s in taken) for step in steps), taken
    wrong = []
    for crash in crashes:
        try:
            coll = load_strictly(QueueCollection(crash.path, configs, runtime=InlineRuntime()))
        except CorruptJournalError as e:
            wrong.append(f"before {crash.step}: refused: {e.reason}")  # the copy kept, to look at
            continue
        if back := set(coll.queue_names()) - set(crash.note):
            wrong.append(f"before {crash.step}: {', '.join(sorted(back))} back after its deletion")
        for queue, outcomes in crash.note.items():
            if not outcomes:  # being created or deleted
                continue
            got = drain(coll, queue)
            if got not in outcomes:
                wrong.append(f"before {crash.step}: {queue} holds {len(got)} items, not "
                             f"{' or '.join(str(len(o)) for o in outcomes)}")
        coll.close()
        shutil.rmtree(crash.path)
    assert not wrong, f"{len(wrong)} of {len(crashes)} crash points:\n" + "\n".join(wrong)


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_fsync(monkeypatch)


@pytest.fixture(params=["kill", "power-cut"])
def cut(request: pytest.FixtureRequest, tmp_path: Path, no_fsync: None) -> Iterator[Disk | None]:
    """What each copy is: what a kill leaves (None), or what a power cut leaves (the `Disk` of the
    queue path `tmp_path/queues`, made here empty, its fsyncs skipped as the kills' are)."""
    if request.param == "kill":
        yield None
        return
    queues = tmp_path / "queues"
    queues.mkdir()
    with Disk(queues) as disk:
        yield disk


def item(n: int) -> bytes:
    return b"%06d" % n + b"x" * 50


@pytest.fixture
def seals(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """When rotated Kestrel 2 journals are sealed into the manifest: at once; after other work had
    turns of the loop (a slow fsync: the pack taken at the rotation may be written first); or only
    once no pack is being written or waits to be (a seal lagging behind later rotations and packs:
    a pack lists itself while journals it replaces are not listed yet)."""
    when: str = request.param
    real = QueueJournal._seal_one

    def late(self: QueueJournal, path: str, *args: Any) -> None:
        for _ in range(5):
            gevent.sleep(0)
        real(self, path, *args)

    def after_packs(self: QueueJournal, path: str, *args: Any) -> None:
        for _ in range(10_000):  # bounded: a seal never waits for good
            if not self.pack_pending:
                break
            gevent.sleep(0)
        real(self, path, *args)

    if when != "at-once":
        monkeypatch.setattr(QueueJournal, "_seal_one", late if when == "late" else after_packs)
    return when


SEALS = [pytest.param("at-once", id="sealed-at-once"),
         pytest.param("late", id="sealed-late", marks=pytest.mark.pure_build),
         pytest.param("after-packs", id="sealed-after-packs", marks=pytest.mark.pure_build)]


def rotating_queue(queues: Path, sync_journal: str) -> tuple[QueueConfigs, QueueCollection]:
    """Queue `q` with journals small enough to rotate every few items and a memory that reads
    behind past 2 KB, loaded strictly into a collection at `queues`: its configs and the collection."""
    q = {"sync_journal": sync_journal, "max_memory_size": 2048, "default_journal_size": 1024,
         "max_journal_size": 1 << 20}
    configs = QueueConfigs({}, {"q": q})
    return configs, load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime()))


@pytest.mark.parametrize("seals", SEALS, indirect=True)
def test_a_kill_or_a_power_cut_at_every_step_of_kestrel2_rotations_and_packs_refuses_nothing(
        tmp_path: Path, seals: str, cut: Disk | None) -> None:
    queues = tmp_path / "queues"
    configs, coll = rotating_queue(queues, "always")
    model = Model(["q"])
    n = 0
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note, disk=cut) as points:
        model.change({"q": [b"held"]}, coll.put, "q", [b"held"])
        model.held["q"], model.items["q"] = [b"held"], []  # opened: back first at every start
        model.change({}, coll.remove, "q", 1, True)
        for round_ in range(4):
            for _ in range(40 + 10 * round_):
                model.change({"q": model.items["q"] + [item(n)]}, coll.put, "q", [item(n)])
                n += 1
                settle(coll, "q")
            for _ in range(45):
                model.change({"q": model.items["q"][1:]}, coll.remove, "q")
                settle(coll, "q")
        model.change({"q": []}, coll.flush, "q")  # emptied: a rotation, and a pack of the open read
        settle(coll, "q")
    coll.close()
    record = manifest.read(str(queues), "q")
    assert record is not None
    assert {name for name, entry in record.files.items() if entry.pack} == {
        name for name in record.files if packer.is_our_pack(str(queues / name))}  # a seal never unmarks a pack
    check(points.crashes, configs, ("rename q -> q.", ".pack -> q.", "unlink q.",
                                    "-> .kestrel/q.manifest"))


@pytest.mark.parametrize("seals", [SEALS[0], SEALS[2]], indirect=True)  # the two extremes
def test_a_kill_or_a_power_cut_at_every_step_of_kestrel2_fanouts_reading_behind_while_seals_lag_refuses_nothing(
        tmp_path: Path, seals: str, cut: Disk | None) -> None:
    """The churn of the end-to-end kills (tests/end_to_end/test_damage_and_durability.py), every
    step of it: `q` fed five items at a time and consumed three at a time, a fanout `q+c` reading
    behind and emptied by flushes (checkpoint packs, and a pack as it catches up), a fanout `q+d`
    created and deleted, under `always` with the commit log, whose checkpoints come between. The
    background work runs every few changes only, so that rotated journals wait to be sealed while
    later rotations and packs are taken."""
    queues = tmp_path / "queues"
    q = {"sync_journal": "always", "max_memory_size": 1024, "default_journal_size": 768,
         "max_journal_size": 4096}
    configs = QueueConfigs({}, {"q": q})
    coll = load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime(), commit_log=True))
    assert coll.commit_log is not None
    coll.queue("q+c")
    model = Model(["q", "q+c"])
    n = 0
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note, disk=cut) as points:
        for burst in range(8):
            for _ in range(3):
                batch = [item(n + i) for i in range(5)]
                n += 5
                model.change({name: items + batch for name, items in model.items.items()}, coll.put, "q", batch)
                model.change({"q": model.items["q"][3:]}, coll.remove, "q", 3)
            if burst % 4 == 3:
                model.change({"q+c": []}, coll.flush, "q+c")
            if burst % 6 == 1:
                model.create("q+d", coll.queue, "q+d")
            elif burst % 6 == 4:
                model.delete("q+d", coll.delete, "q+d")
            settle(coll, *model.items)
            if burst % 3 == 1:
                coll.commit_log.checkpoint()
    coll.close()
    check(points.crashes, configs, ("rename q -> q.", "rename q+c -> q+c.", ".pack -> q+c.", "unlink q+c.",
                                    "-> .kestrel/q+c.manifest", "unlink q+d", "create .kestrel/commit-log/",
                                    "unlink .kestrel/commit-log/"))


@pytest.mark.parametrize("log", [False, True], ids=["commit_log-off", "commit_log-on"])
def test_a_kill_or_a_power_cut_at_every_step_of_kestrel3_rotations_rewrites_and_deletions_refuses_nothing(
        tmp_path: Path, cut: Disk | None, log: bool) -> None:
    queues = tmp_path / "queues"
    q = {"journal_format": "kestrel3", "sync_journal": "always", "default_journal_size": 1024}
    configs = QueueConfigs({}, {"q": q})
    coll = load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime(), commit_log=log))
    coll.queue("q+c")
    model = Model(["q", "q+c"])
    n = 0
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note, disk=cut) as points:
        model.change({"q": [b"held"], "q+c": [b"held"]}, coll.put, "q", [b"held"])
        model.held["q"], model.items["q"] = [b"held"], []  # opened: back first at every start
        model.change({}, coll.remove, "q", 1, True)
        for round_ in range(5):
            for _ in range(30):
                model.change({name: items + [item(n)] for name, items in model.items.items()},
                             coll.put, "q", [item(n)])
                n += 1
                settle(coll, "q", "q+c")
            for _ in range(25):
                model.change({"q": model.items["q"][1:]}, coll.remove, "q")
                settle(coll, "q", "q+c")
            model.change({"q+c": model.items["q+c"][10:]}, coll.remove, "q+c", 10)
            if round_ % 2:
                model.change({"q": []}, coll.flush, "q")  # emptied by a checkpoint rewrite
            else:
                model.change({"q+c": []}, coll.flush, "q+c")
            model.create("q+d", coll.queue, "q+d")  # a fanout reader created and deleted: its
            model.delete("q+d", coll.delete, "q+d")  # checkpoint comes and goes
            settle(coll, "q", "q+c")
    coll.close()
    check(points.crashes, configs, ("create q.", "unlink q.", "-> .kestrel/q.manifest"))


def test_a_kill_at_every_step_of_a_kestrel3_checkpoint_rewritten_once_large_refuses_nothing(
        tmp_path: Path) -> None:
    """A reader's checkpoint grown past `COMPACT_AT` is rewritten after the change that grew it, off
    the loop (its manifest entry, then the file): a kill at each step leaves the old file or the new
    one whole, and the queue holds what was acknowledged."""
    queues = tmp_path / "queues"
    configs = QueueConfigs({}, {"q": {"journal_format": "kestrel3"}})  # (a kill keeps what is not fsynced)
    coll = load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime()))
    coll.queue("q+c")
    items = [item(n) for n in range(16_000)]  # each remove appends 9 bytes: 7,300 to grow past 64 KB
    coll.put("q", items)
    model = Model(["q", "q+c"])
    model.items = {"q": list(items), "q+c": list(items)}
    checkpoint = queues / "q.read."
    rewrites = 0
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note) as points:
        while rewrites < 2:
            size = checkpoint.stat().st_size
            model.change({"q": model.items["q"][1:]}, coll.remove, "q")
            settle(coll, "q")  # the rewrite, when due, runs here
            rewrites += checkpoint.stat().st_size < size
        model.change({"q+c": model.items["q+c"][5:]}, coll.remove, "q+c", 5)
    coll.close()
    check(points.crashes, configs, ("create q~~read.", "q~~read. -> q.read.", "-> .kestrel/q.manifest"))


def test_a_rotation_while_a_pack_taken_at_once_is_written_then_its_failure_keeps_rotation_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `never` the journal rotated for a pack taken at once is neither fsynced nor sealed, and
    is sealed only if that pack fails before it is in place; a journal rotated while the pack is
    written (the journal allows it; the queue's scheduling takes no such rotation today) is sealed
    behind it all the same, so that no kill finds it listed while the older one is not (a stray)."""
    queues = tmp_path / "queues"
    q = {"sync_journal": "never", "max_memory_size": 1 << 20, "default_journal_size": 1 << 20,
         "max_journal_size": 1 << 30}
    configs = QueueConfigs({}, {"q": q})
    coll = load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime()))
    queue = coll.queue("q")
    model = Model(["q"])
    failed: list[str] = []

    mine = packing_under(monkeypatch, tmp_path)

    def fail_once(step: str) -> None:
        if step == "write" and not failed and mine():
            failed.append(step)
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(packer, "failpoint", fail_once)
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note) as points:
        model.change({"q": [item(0), item(1)]}, coll.put, "q", [item(0), item(1)])
        with queue:
            queue._pack_now()  # rotated at once for a pack, and the pack started: not written yet
            queue._journal.start_next_pack()
            queue._rotate(checkpoint=False)  # a rotation while the pack is written
        model.change({"q": [item(0), item(1), item(2)]}, coll.put, "q", [item(2)])
        settle(coll, "q")  # the pack fails; both journals are sealed
    coll.close()
    assert failed
    record = manifest.read(str(queues), "q")
    assert record is not None and len(record.files) == 2 and not any(e.pack for e in record.files.values())
    check(points.crashes, configs, ("-> .kestrel/q.manifest",))


def test_an_older_copy_of_a_packed_journal_put_back_at_every_step_is_refused_once_the_pack_is_in_place(
        tmp_path: Path) -> None:
    """A pack takes its final name once every journal up to its own is deleted, so a journal older
    than a pack found there is a copy put back: at every step of rotations and packs, each start
    with such a copy beside the pack refuses it, naming it, whatever the manifest has recorded of
    that pack so far (before, one start just after the pack's final rename replayed it)."""
    queues = tmp_path / "queues"
    configs, coll = rotating_queue(queues, "always")
    for n in range(60):  # read-behind: rotated journals
        coll.put("q", [item(n)])
        settle(coll, "q")
    oldest = min(p for p in queues.iterdir() if p.name[2:].isdigit())
    stray, backup = oldest.name, oldest.read_bytes()
    model = Model(["q"])
    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note) as points:
        for _ in range(60):
            coll.remove("q")
            settle(coll, "q")
        for n in range(60, 100):
            coll.put("q", [item(n)])
            coll.remove("q")
            settle(coll, "q")
    coll.close()
    probed, window, wrong = [], [], []
    for crash in points.crashes:
        copy = Path(crash.path)
        packs = [p.name for p in copy.iterdir() if p.name[2:].isdigit() and int(p.name[2:]) > int(stray[2:])
                 and packer.is_our_pack(str(p))]
        if packs and not (copy / stray).exists():
            record = manifest.read(str(copy), "q")
            if record is not None and any(f"{pack}.pack" in record.files for pack in packs):
                window.append(crash.step)  # renamed, not yet recorded at its final name
            (copy / stray).write_bytes(backup)
            probed.append(crash.step)
            try:
                load_strictly(QueueCollection(str(copy), configs, runtime=InlineRuntime())).close()
                wrong.append(f"before {crash.step}: loaded")
            except CorruptJournalError as e:
                if e.path != str(copy / stray):
                    wrong.append(f"before {crash.step}: refused for {e.path}: {e.reason}")
        shutil.rmtree(copy)
    assert window, probed
    assert not wrong, f"{len(wrong)} of {len(probed)} crash points:\n" + "\n".join(wrong)


def packing_under(monkeypatch: pytest.MonkeyPatch, path: Path) -> Callable[[], bool]:
    """Whether the pack being written is one of the queue path `path` (another test's abandoned
    queue may pack meanwhile, and a fault meant for this one must not hit it)."""
    mine = [False]
    real = packer.write_pack

    def write_pack(req: packer.PackRequest, *args: Any) -> str:
        mine[0] = Path(req.queue_path).is_relative_to(path)
        return real(req, *args)

    monkeypatch.setattr(packer, "write_pack", write_pack)
    return lambda: mine[0]


PACK_STEPS = ("write", "fsync", "rename-pack", "delete", "rename-final")  # packer.failpoint's names


@pytest.fixture
def fault(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """One disk error in this test's queue path, once armed (the list it returns made non-empty):
    in the rename of a rotation, at a step of a pack, in the fsync of the directory after its final
    rename, in the manifest write of a pack listing itself (`listing`) or of a pack in place
    (`listed`), or in a rotated journal's seal; the step's name is added to the list as it fires."""
    where: str = request.param
    fired: list[str] = []

    def fire() -> None:
        fired.append(where)
        raise OSError(errno.EIO, f"Input/output error (simulated, {where})")

    packing = packing_under(monkeypatch, tmp_path)

    def due(here: bool = True) -> bool:
        return len(fired) == 1 and here  # armed, not fired yet

    def mine(path: str) -> bool:
        return Path(path).is_relative_to(tmp_path)

    if where in PACK_STEPS:
        monkeypatch.setattr(packer, "failpoint", lambda step: fire() if step == where and due(packing()) else None)
    elif where == "sync-final":  # the directory's fsync after the final rename
        renamed = [False]
        real_sync = packer.fsync_path

        def note(step: str) -> None:
            renamed[0] = step == "rename-final"

        def sync(path: str) -> None:
            if renamed[0] and due(mine(path)):
                fire()
            real_sync(path)

        monkeypatch.setattr(packer, "failpoint", note)
        monkeypatch.setattr(packer, "fsync_path", sync)
    elif where == "rotate":  # the rename of the live journal
        real_rename = os.rename
        monkeypatch.setattr(os, "rename", lambda src, dst: fire() if os.path.basename(src) == "q"
                            and due(mine(src)) else real_rename(src, dst))
    elif where == "seal":
        real_seal = manifest.seal
        monkeypatch.setattr(manifest, "seal", lambda path, *args, **kw: fire() if due(mine(path))
                            else real_seal(path, *args, **kw))
    else:
        method = "_pack_placed" if where == "listing" else "_pack_finished"
        real = getattr(QueueJournal, method)

        def failing_write(self: QueueJournal, *args: Any) -> None:
            if not due(mine(self.queue_path)):
                return real(self, *args)
            with monkeypatch.context() as m:
                m.setattr(manifest, "write", lambda *a: fire())
                return real(self, *args)

        monkeypatch.setattr(QueueJournal, method, failing_write)
    return fired


@pytest.mark.parametrize("fault", ["rotate", *PACK_STEPS, "sync-final", "listing", "listed", "seal"],
                         indirect=True)
@pytest.mark.parametrize("seals", [SEALS[0], SEALS[2]], indirect=True)
def test_a_disk_error_then_a_kill_at_every_later_step_of_kestrel2_packs_refuses_nothing(
        tmp_path: Path, seals: str, fault: list[str]) -> None:
    """Under `never` (a journal rotated for a pack taken at once is neither fsynced nor sealed
    unless the pack fails), with the background work every few changes: a disk error at one step
    of a pack or a seal, then a kill at any later step. Each start refuses nothing and finds every
    item, and the queue goes on meanwhile: the manifest lists no pack that failed."""
    queues = tmp_path / "queues"
    configs, coll = rotating_queue(queues, "never")
    model = Model(["q"])
    n = changes = 0

    def change(after: list[bytes], fn: Callable[..., Any], *args: Any) -> None:
        nonlocal changes
        model.change({"q": after}, fn, *args)
        changes += 1
        if changes % 3 == 0:
            settle(coll, "q")

    with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note, lambda: bool(fault)) as points:
        for round_ in range(3):
            if round_ == 1:
                fault.append("armed")
            for _ in range(40 + 10 * round_):
                change(model.items["q"] + [item(n)], coll.put, "q", [item(n)])
                n += 1
            for _ in range(45):
                change(model.items["q"][1:], coll.remove, "q")
        change([], coll.flush, "q")
        settle(coll, "q")
    coll.close()
    assert len(fault) == 2, f"the fault at {fault} never fired"
    record = manifest.read(str(queues), "q")  # a pack listed as being put in place is there
    assert record is not None and all((queues / name).exists() for name in record.files if name.endswith(".pack"))
    check(points.crashes, configs, ())



SYNC_MS = 5  # a periodic sync's interval


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_power_cut_at_every_step_under_a_periodic_sync_keeps_what_an_interval_synced(
        tmp_path: Path, journal_format: str) -> None:
    """Under `sync_journal` every few ms, without the commit log, batches of changes each waiting
    out the interval after it (its journal's periodic fsync and the seals of the files it rotated
    run then): a power cut at every step keeps every batch synced, through the rotations that start
    new files (a Kestrel 2 live journal, a Kestrel 3 writer file, rotated with the one before it not
    yet synced), and of the batch being synced any part, refusing nothing."""
    queues = tmp_path / "queues"
    queues.mkdir()
    q = {"journal_format": journal_format, "sync_journal": f"{SYNC_MS}ms", "max_memory_size": 2048,
         "default_journal_size": 1024, "max_journal_size": 1 << 20}
    configs = QueueConfigs({}, {"q": q})
    with Disk(queues) as cut:
        coll = load_strictly(QueueCollection(str(queues), configs, runtime=InlineRuntime()))

        def synced(changes: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
            """Each change, then the interval waited out: the periodic fsync, and the seals, done."""
            for fn, args in changes:
                fn(*args)
            gevent.sleep(SYNC_MS * 3 / 1000)
            settle(coll, "q")

        model = Model(["q"])
        n = 0
        with CrashPoints(str(queues), str(tmp_path / "crashes"), model.note, disk=cut) as points:
            for size in (1, 5, 30, 3):
                for _ in range(6):
                    steps = [{"q": model.items["q"] + [item(n + i) for i in range(k + 1)]} for k in range(size)]
                    model.batch(steps, synced, [(coll.put, ("q", [item(n + i)])) for i in range(size)])
                    n += size
                for _ in range(4):
                    steps = [{"q": model.items["q"][k + 1:]} for k in range(size)]
                    model.batch(steps, synced, [(coll.remove, ("q",))] * size)
        coll.close()
    check(points.crashes, configs, ("fdatasync q",))
