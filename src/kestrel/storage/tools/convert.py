"""`kestrel journal convert --to kestrel3|kestrel2 QUEUE_PATH [QUEUE...]`: queues from one journal
format to the other, offline, working on the files directly.

One unit is converted at a time: a Kestrel 3 queue `q` and its readers are the Kestrel 2 queue `q`
(the default reader) and its fanout children `q+<reader>`. Kestrel 2 → 3 reads each queue with the
read-only replay, its open reads first (back at the head, as a restart returns them), and writes one
writer journal, ids from 1 in order, a block of ids per reader, and each reader's checkpoint marking
the other readers' blocks as done. Kestrel 3 → 2 writes one journal of ADDX records per reader, of
the items its checkpoint has not consumed. Expiry and add times are kept; error counts are lost
going to Kestrel 2, which has no field for them.

Crash-safe in three steps: the new files are written under `~~` temporary names and fsynced (a
crash leaves the old format, and start-up deletes temporaries); then `<queue_path>/.kestrel/convert`, naming
the renames and deletions still to do, is put in place in one rename: from that moment the new
format is the queue's, and whoever opens the queue path next (the converter or a server starting)
finishes those steps before anything else; then the temporaries are renamed, the old files deleted
and `.kestrel/convert` removed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from kestrel.storage import filenames, layout, manifest
from kestrel.storage.clock import SYSTEM_CLOCK, Clock
from kestrel.storage.commit_log import recover as recover_commit_log
from kestrel.storage.config import JOURNAL_FORMATS
from kestrel.storage.disk import fsync_path
from kestrel.storage.errors import (
    ConvertError,
    CorruptJournalError,
    InvalidQueueName,
    QueuePathInUse,
)
from kestrel.storage.formats import (
    INTENT_NAME,
    KESTREL2,
    KESTREL3,
    Intent,
    finish_intent,
    finish_interrupted,
    format_title,
    ignored_names,
    queues_on_disk,
    refused_on_disk,
    step,
    stray_checkpoints,
    write_intent,
)
from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2 import journal as kestrel2_journal
from kestrel.storage.kestrel2.replay import QueueReplay, replay_files
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3 import journal as kestrel3_journal
from kestrel.storage.kestrel3.files import (
    ReaderCheckpoint,
    checkpoint_entry,
    encode_checkpoint,
    list_queue_files,
    pending_items,
    read_checkpoint,
)
from kestrel.storage.lock import QueuePathLock, left_alone
from kestrel.storage.queue_path import list_journal_files

# ---------------------------------------------------------------------------------------------
# Converting one unit


@dataclass
class Converted:
    """What one unit's conversion moved: items per reader (Kestrel 3) or queue (Kestrel 2)."""

    queue: str
    items: dict[str, int]
    reopened: int = 0  # open reads that became items at the head (Kestrel 2 → 3)
    notes: list[str] = field(default_factory=list)


def _manifest_name(queue: str) -> str:
    """The queue's manifest, relative to the queue path (in the server's own directory)."""
    return os.path.join(filenames.OWN_DIRECTORY, filenames.manifest_name(queue))


def _remove_temporaries(queue_path: str, unit: str | None = None) -> None:
    """Delete the new files of a conversion that did not reach its switch (of `unit` only, if given)."""
    for entry in os.scandir(queue_path):
        owner, infix, _ = entry.name.partition(filenames.CONVERSION_MARK)
        if infix and (unit is None or owner.partition("+")[0] == unit):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    if unit is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(queue_path, INTENT_NAME + filenames.TEMPORARY_MARK))


def _write_file(path: str, chunks: Iterable[bytes]) -> None:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _is_placeholder(item: QItem) -> bool:
    """A pack's stand-in for an item already gone (empty, expired 1 ms after the epoch)."""
    return not item.data and item.expiry == codec.PLACEHOLDER_EXPIRY


def _kestrel2_queue(queue_path: str, name: str, now: int, notes: list[str]) -> tuple[list[QItem], int]:
    """A Kestrel 2 queue's items as a restart would serve them, and how many were open reads."""
    kestrel2_journal.check_files(queue_path, name)  # no stray, missing or changed file is converted
    state = QueueReplay()
    state.run(replay_files(queue_path, name), now)
    if state.torn_tail is not None:
        _refuse_torn_tail(*state.torn_tail)
    if state.anomalies:
        notes.append(f"{name}: records with nothing to act on {state.anomalies} "
                     "(a journal file may be missing)")
    items = [item for item in state.restart_order() if not _is_placeholder(item)]
    return items, len(state.opens)


def _refuse_torn_tail(path: str, offset: int) -> None:
    """A torn tail is the next start's to cut (keeping a copy), not the converter's. Raises
    CorruptJournalError."""
    raise CorruptJournalError(path, offset, None, "the journal ends in a record the process did not "
                              "finish writing: start the server once (it cuts it off, keeping a copy), "
                              "then convert")


def _all_kestrel2_files(queue_path: str, name: str) -> list[str]:
    """Every file of Kestrel 2 queue `name`, its manifest included."""
    files = list_journal_files(queue_path, name)
    record = [_manifest_name(name)] if os.path.exists(manifest.path_of(queue_path, name)) else []
    return [os.path.basename(p) for p in files.replay_order() + [p for _, p in files.packs]] + record


def _to_kestrel3(queue_path: str, unit: str, members: list[str], clock: Clock) -> tuple[Intent, Converted]:
    """Write the unit's Kestrel 3 files as temporaries; the intent that puts them in place."""
    readers = {("" if name == unit else name.partition("+")[2]): name for name in members}
    if "" not in readers:
        readers[""] = ""  # a fanout-only parent: its default reader gets nothing
    now = clock.now_ms()
    result = Converted(unit, {})
    blocks: list[tuple[str, list[QItem]]] = []
    old: list[str] = []
    for reader in sorted(readers):
        name = readers[reader]
        if not name:
            blocks.append((reader, []))
            continue
        items, reopened = _kestrel2_queue(queue_path, name, now, result.notes)
        result.reopened += reopened
        result.items[name] = len(items)
        blocks.append((reader, items))
        old.extend(_all_kestrel2_files(queue_path, name))
    number = max([now] + [ts + 1 for ts, _ in list_journal_files(queue_path, unit).rotated])  # no name clash
    writer_name = filenames.writer_file_name(unit, number)
    intent = Intent(KESTREL3, unit, deletes=old)

    def puts() -> Iterator[bytes]:
        yield k3.WRITER_MAGIC
        item_id = 0
        for _reader, items in blocks:
            for item in items:
                item_id += 1
                yield k3.encode(k3.Put(item_id, item.errors, item.add_time, item.expiry or None, item.data))

    temporary = filenames.conversion_temporary_name(unit, writer_name)
    _write_file(os.path.join(queue_path, temporary), puts())
    intent.renames.append((temporary, writer_name))
    total = sum(len(items) for _, items in blocks)
    record = manifest.Manifest(KESTREL3, {writer_name: manifest.Entry()}, high_id=total)
    first = 1
    for reader, items in blocks:
        last = first + len(items) - 1
        checkpoint = ReaderCheckpoint(first - 1, frozenset(range(last + 1, total + 1)))
        final = filenames.reader_file_name(unit, reader)
        temporary = filenames.conversion_temporary_name(unit, final)
        _write_file(os.path.join(queue_path, temporary), [encode_checkpoint(checkpoint)])
        intent.renames.append((temporary, final))
        record.files[final] = checkpoint_entry(checkpoint)
        first = last + 1
    # The unit's new manifest replaces the Kestrel 2 one of the same name in its rename.
    record_name = _manifest_name(unit)
    temporary = filenames.conversion_temporary_name(unit, filenames.manifest_name(unit))
    _write_file(os.path.join(queue_path, temporary), [manifest.encode(record)])
    intent.renames.append((temporary, record_name))
    intent.deletes = [d for d in intent.deletes if d != record_name]
    for path in stray_checkpoints(queue_path, unit):  # ids from 1 now: its head would skip new items
        copy = layout.set_aside(queue_path, path, "stray", now)
        result.notes.append(f"{os.path.basename(path)}: a Kestrel 3 reader checkpoint with no writer file, "
                            f"which no start read: set aside as {copy}")
    return intent, result


def _to_kestrel2(queue_path: str, unit: str) -> tuple[Intent, Converted]:
    """Write one Kestrel 2 journal per reader of the unit as temporaries; the intent that puts
    them in place."""
    kestrel3_journal.check_files(queue_path, unit)  # no stray, missing or changed file is converted
    files = list_queue_files(queue_path, unit)
    readers = dict(files.readers)
    result = Converted(unit, {})
    intent = Intent(KESTREL2, unit, deletes=[os.path.basename(p) for _, p in files.writers]
                    + [os.path.basename(p) for p in readers.values()] + [_manifest_name(unit)])
    for reader in sorted(set(readers) | {""}):
        name = f"{unit}+{reader}" if reader else unit
        try:
            filenames.check_queue_name(name)
        except InvalidQueueName as e:
            raise ConvertError(f"reader {reader!r} of {unit!r} cannot become a Kestrel 2 queue: "
                               f"{e}") from None
        existing = list_journal_files(queue_path, name)
        if existing.live or existing.packs or (reader and existing.rotated):
            raise ConvertError(f"{name!r} already has Kestrel 2 journal files in {queue_path}")
        tally = _Tally()
        records = _addx_records(queue_path, unit, read_checkpoint(readers.get(reader)), tally)
        temporary = filenames.conversion_temporary_name(name, name)
        _write_file(os.path.join(queue_path, temporary), records)
        intent.renames.append((temporary, name))
        result.items[name] = tally.items
        if tally.with_errors:
            result.notes.append(f"{name}: the error counts of {tally.with_errors} items are not kept "
                                "(Kestrel 2 journals have no field for them)")
    return intent, result


@dataclass
class _Tally:
    items: int = 0
    with_errors: int = 0


def _addx_records(queue_path: str, unit: str, checkpoint: ReaderCheckpoint, tally: _Tally) -> Iterator[bytes]:
    """The items `checkpoint` has not consumed as Kestrel 2 ADDX records, counted in `tally`."""
    for put in pending_items(queue_path, unit, checkpoint, torn_tail=_refuse_torn_tail):
        tally.items += 1
        tally.with_errors += put.error_count > 0
        yield codec.encode_addx(put.add_time, put.expire_time or 0, put.data)


def convert_unit(queue_path: str, unit: str, to: str, members: list[str],
                 clock: Clock = SYSTEM_CLOCK) -> Converted:
    """Convert one unit (`members`: its Kestrel 2 queue names, for `to` kestrel3), crash-safe.

    Raises ConvertError, CorruptJournalError, OSError; before the switch nothing is changed (the
    temporaries written so far are removed), after it the conversion is finished by the next
    `finish_interrupted`.
    """
    try:
        if to == KESTREL3:
            intent, result = _to_kestrel3(queue_path, unit, members, clock)
        else:
            intent, result = _to_kestrel2(queue_path, unit)
        fsync_path(queue_path)
        step("written")
    except Exception:
        _remove_temporaries(queue_path, unit)  # a crash leaves them to the next start-up instead
        raise
    write_intent(queue_path, intent)
    step("switched")
    finish_intent(queue_path, intent)
    return result


# ---------------------------------------------------------------------------------------------
# The command


def _units(on_disk: dict[str, str], to: str, named: list[str]) -> dict[str, list[str]]:
    """The units to convert, each with its members in the source format; named ones must exist."""
    source = KESTREL2 if to == KESTREL3 else KESTREL3

    def unit_of(name: str) -> str:  # a Kestrel 2 fanout child belongs to its parent's unit
        return name.partition("+")[0] if source == KESTREL2 else name

    units: dict[str, list[str]] = {}
    for name, fmt in sorted(on_disk.items()):
        if fmt == source:
            units.setdefault(unit_of(name), []).append(name)
    for unit, members in units.items():
        if on_disk.get(unit, source) != source:
            raise ConvertError(f"{unit!r} is in {format_title(on_disk[unit])} format but its fanout children "
                               f"{', '.join(members)} are not: a queue and its readers convert together")
    if not named:
        return units
    chosen = {}
    for name in named:
        unit = unit_of(name)
        if unit in units:
            chosen[unit] = units[unit]
        elif not any(unit_of(n) == unit for n in on_disk):
            raise ConvertError(f"no queue {name!r} in this queue path")
    return chosen


@dataclass
class Summary:
    """What a run converted, and the queues it left as they were (each named in its output, with why)."""

    converted: list[Converted] = field(default_factory=list)
    not_converted: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    """What a run converts, and what it leaves and why: read before the lock is taken too."""

    units: dict[str, list[str]]
    not_converted: list[str]
    lines: list[str]


def _plan(queue_path: str, to: str, named: list[str]) -> _Plan:
    """The units to convert, and the queues on disk left as a start leaves them (only those of the
    named units when queues are named), with a line saying why each is; reads only."""
    on_disk = queues_on_disk(queue_path)
    lines = [] if on_disk or named else [f"{queue_path}: no queue journals found\n"]  # a mistyped path
    left = []
    for name, why in sorted(ignored_names(on_disk).items()):
        lines.append(f"{name!r}: not converted: {why}\n")
        left.append(name)
        del on_disk[name]
    for name, refused in sorted(refused_on_disk(queue_path).items()):  # a start refuses it
        lines.append(f"{name}: not converted: {refused}; {refused.remedy()}\n")
        left.append(name)
        on_disk.pop(name, None)
    units = _units(on_disk, to, named)
    for name in named:
        if name not in units and name.partition("+")[0] not in units:
            lines.append(f"{name}: already {to}, nothing to do\n")
    chosen = {name.partition("+")[0] for name in named}
    return _Plan(units, [n for n in left if not named or n.partition("+")[0] in chosen], lines)


def convert(queue_path: str, to: str, named: list[str], out: TextIO = sys.stdout,
            clock: Clock = SYSTEM_CLOCK) -> Summary:
    """Convert the named queues (every queue of the path when none is named) under the path's lock.
    A directory no server owned (`layout.owned`) with nothing to convert is only reported on, no
    lock file made: a folder that is no queue path is left as it is.

    Raises QueuePathInUse (a server holds the path), ConvertError, CorruptJournalError, OSError.
    """
    if not os.path.isdir(queue_path):
        raise ConvertError(f"{queue_path} is not a directory")
    if left_alone(queue_path):
        plan = _plan(queue_path, to, named)
        if not plan.units:
            out.writelines(plan.lines)
            return _summary(queue_path, to, Summary([], plan.not_converted), out)
    with QueuePathLock(queue_path) as lock:
        lock.acquire(f"kestrel journal convert --to {to}")
        recovery = recover_commit_log(queue_path, clock.now_ms())  # its records name Kestrel 2 journals
        if recovery.written:
            out.write(f"{queue_path}: the commit log a crash left put {recovery.written} records into the "
                      "journals\n")
        if recovery.refused:
            queue, error = min(recovery.refused.items())
            raise ConvertError(f"queue {queue!r}: {error}; {error.remedy()}")
        finished = finish_interrupted(queue_path)
        if finished is not None:
            out.write(f"{finished}: finished the conversion a crash interrupted\n")
        _remove_temporaries(queue_path)
        plan = _plan(queue_path, to, named)
        out.writelines(plan.lines)
        summary = Summary([], plan.not_converted)
        for unit, members in plan.units.items():
            out.write(f"{unit}: converting {', '.join(members)} to {to} ...\n")
            out.flush()
            result = convert_unit(queue_path, unit, to, members, clock)
            for note in result.notes:
                out.write(f"{unit}: note: {note}\n")
            counts = ", ".join(f"{name or unit} {n} items" for name, n in result.items.items()) or "no items"
            reopened = f" ({result.reopened} open reads back at the head)" if result.reopened else ""
            out.write(f"{unit}: converted to {to}: {counts}{reopened}\n")
            summary.converted.append(result)
        return _summary(queue_path, to, summary, out)


def _summary(queue_path: str, to: str, summary: Summary, out: TextIO) -> Summary:
    items = sum(sum(r.items.values()) for r in summary.converted)
    left = f", {len(summary.not_converted)} not converted (said above)" if summary.not_converted else ""
    out.write(f"converted {len(summary.converted)} queues ({items} items) to {to} in {queue_path}{left}; set "
              f"journal_format: {to} for them in the config before starting the server\n")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, choices=JOURNAL_FORMATS, help="the format to write")
    parser.add_argument("queue_path", metavar="QUEUE_PATH", help="the server's queue path")
    parser.add_argument("queues", nargs="*", metavar="QUEUE",
                        help="queues to convert (with their fanout children); all when none is named")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        summary = convert(args.queue_path, args.to, args.queues, out)
    except QueuePathInUse as e:
        print(f"kestrel journal convert: {e}", file=err)
        return 3
    except (ConvertError, CorruptJournalError, InvalidQueueName) as e:
        print(f"kestrel journal convert: {e}", file=err)
        return 1
    except OSError as e:
        print(f"kestrel journal convert: {e.filename or args.queue_path}: {e.strerror or e}", file=err)
        return 1
    return 1 if summary.not_converted else 0  # as for a damaged journal: a queue is not in the new format
