"""`kestrel journal check QUEUE_PATH [QUEUE...]`: what a start-up would find in a queue path, and
what `--salvage` would set aside, without changing anything.

For the commit log a crash left: the records recovery would write into journals, the journals it
would repair from the log (a copy kept) and the queues it would refuse. For each queue (every queue
of the path when none is named): the files that do not match its manifest, the damaged records,
what salvage would set aside (files and item counts, src/kestrel/storage/damage.py), and a torn
tail the next start cuts off. It reads only: no file is cut, renamed, written or created, and it
refuses to run while a server holds the path.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from kestrel.storage import commit_log, damage, formats, layout, lock, torn_tail
from kestrel.storage.clock import SYSTEM_CLOCK
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.formats import (
    KESTREL3,
    ignored_names,
    queues_on_disk,
    refused_on_disk,
    stray_checkpoints,
)
from kestrel.storage.kestrel2 import journal as kestrel2_journal
from kestrel.storage.kestrel2.replay import QueueReplay, replay_files
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3 import journal as kestrel3_journal
from kestrel.storage.kestrel3.files import RecordReader, header_unwritten, list_queue_files, read_checkpoint

EXIT_DAMAGED = 1
EXIT_USAGE = 2  # what was asked for is not there: a path that is not a directory, a queue not in it
EXIT_IN_USE = 3


class Report:
    """What was found for one queue: damage (with its salvage plan) and notes."""

    def __init__(self) -> None:
        self.findings: list[damage.Finding] = []
        self.notes: list[str] = []

    def damaged(self, error: CorruptJournalError, header: int = 0, also: str = "") -> None:
        self.findings.append(damage.record_damage(error, header, also))


def check_kestrel2(queue_path: str, name: str, report: Report, manifests: bool) -> None:
    if manifests:
        try:
            report.findings += kestrel2_journal.manifest_findings(queue_path, name)
        except CorruptJournalError as e:
            report.findings.append(damage.Finding(e.path, e.reason, damage.Remedy.SET_ASIDE, e.offset,
                                                  also="the queue then loads as one without a manifest"))
    replay = QueueReplay()
    try:
        replay.run(replay_files(queue_path, name))
    except CorruptJournalError as e:
        report.damaged(e)
        return
    if replay.torn_tail is not None:
        path, offset = replay.torn_tail
        report.notes.append(torn_tail.cut_note(path, offset))
    if replay.anomalies:
        report.notes.append(f"records with nothing to act on: {replay.anomalies} (a file before may be "
                            "missing)")
    report.notes.append(f"{len(replay.restart_order())} items, {len(replay.opens)} of them open reads")
    for path in stray_checkpoints(queue_path, name):
        report.notes.append(f"{os.path.basename(path)} is a Kestrel 3 reader checkpoint with no writer file: "
                            "no start reads it, and a conversion to Kestrel 3 sets it aside")


def check_kestrel3(queue_path: str, name: str, report: Report, manifests: bool) -> None:
    if manifests:
        try:
            report.findings += kestrel3_journal.manifest_findings(queue_path, name)
        except CorruptJournalError as e:
            report.findings.append(damage.Finding(e.path, e.reason, damage.Remedy.SET_ASIDE, e.offset))
    files = list_queue_files(queue_path, name)
    last_id = 0
    items = 0
    for _number, path in files.writers:
        if header_unwritten(path):
            report.notes.append(f"{os.path.basename(path)} was created but its header never reached the "
                                "disk: the next start writes it")
            continue
        try:
            reader = RecordReader(path, k3.FileKind.WRITER)
        except CorruptJournalError as e:
            report.damaged(e, k3.MAGIC_SIZE)
            continue
        try:
            for offset, record in reader:
                assert isinstance(record, k3.Put)
                if record.id <= last_id:
                    raise CorruptJournalError(path, offset, None, f"item id {record.id} does not follow id "
                                              f"{last_id}: ids must increase")
                last_id = record.id
                items += 1
            if reader.torn:
                error = reader.tail_damage()
                if error is not None:
                    report.damaged(error, k3.MAGIC_SIZE)
                else:
                    report.notes.append(torn_tail.cut_note(path, reader.offset))
        except CorruptJournalError as e:
            report.damaged(e, k3.MAGIC_SIZE)
        finally:
            reader.close()
    for reader_name, path in sorted(files.readers.items()):
        try:
            torn_at = read_checkpoint(path, last_id or None, repair=False).torn_at
            if torn_at is not None:
                report.notes.append(f"{torn_tail.cut_note(path, torn_at)}; reader {reader_name!r} is served "
                                    "again what the cut records consumed")
        except CorruptJournalError as e:
            report.damaged(e, k3.MAGIC_SIZE,
                           f"reader {reader_name!r} is served again what it consumed after that")
    report.notes.append(f"{items} items written, {len(files.readers)} readers")


def check(queue_path: str, queues: list[str], out: TextIO) -> int:
    """Report on the queue path; 0 when nothing is damaged, 1 when something is, else 2 when a queue
    named is not there."""
    earlier = sorted(e.name for e in os.scandir(queue_path) if layout.earlier_name(e.name, e.is_dir()))
    if earlier:
        out.write(f"{queue_path}: an earlier layout's files ({', '.join(earlier)}): the next start moves "
                  "them into .kestrel/; the manifests are checked once they are there\n")
    damaged = 0
    try:
        intent = formats.interrupted_conversion(queue_path)
        if intent is not None:
            out.write(f"{queue_path}: a conversion of queue {intent.queue!r} to {intent.to} stopped part "
                      "way: the next start completes it\n")
    except CorruptJournalError as e:  # what a start stops on (exit 3), before any queue
        out.write(f"{queue_path}: damaged: {e.path}: {e.reason}: {formats.INTENT_REMEDY}\n")
        damaged += 1
    recovery = commit_log.recover(queue_path, SYSTEM_CLOCK.now_ms(), dry_run=True)
    if recovery.written or recovery.refused or commit_log.pending(queue_path):
        out.write(f"{queue_path}: commit log: {recovery.written} records to write into the journals\n")
        for copy in recovery.copies:
            out.write(f"{queue_path}: commit log: a journal is repaired from the log, what it held kept as "
                      f"{copy}\n")
        for queue, error in sorted(recovery.refused.items()):
            out.write(f"{queue}: refused: {error}\n{queue}:   {error.remedy()}\n")
            damaged += 1
        out.write(f"{queue_path}: the queues below are judged as their journals stand before recovery\n")
    on_disk = queues_on_disk(queue_path)
    if not on_disk and not queues:  # say so: a mistyped path would otherwise pass in silence
        out.write(f"{queue_path}: no queue journals found\n")
    missing = [name for name in queues if name not in on_disk]
    for name in missing:
        out.write(f"{name}: no such queue in {queue_path}\n")
    ignored = ignored_names(on_disk)
    refused = refused_on_disk(queue_path)
    for name, fmt in sorted(on_disk.items()):
        if queues and name not in queues:
            continue
        if name in ignored:
            out.write(f"{name!r}: not loaded: {ignored[name]}\n")
            damaged += 1
            continue
        if name in refused:  # refused at a start, as a damaged queue is
            out.write(f"{name}: refused: {refused[name]}\n{name}:   {refused[name].remedy()}\n")
            damaged += 1
            continue
        report = Report()
        try:
            (check_kestrel3 if fmt == KESTREL3 else check_kestrel2)(queue_path, name, report, not earlier)
        except OSError as e:
            out.write(f"{name}: cannot read {e.filename or queue_path}: {e.strerror or e}\n")
            damaged += 1
            continue
        if not report.findings:
            out.write(f"{name} ({fmt}): ok; {'; '.join(report.notes)}\n")
            continue
        damaged += 1
        out.write(f"{name} ({fmt}): damaged\n")
        for finding in report.findings:
            out.write(f"{name}:   {finding.path} at offset {finding.offset}: {finding.why}\n")
        out.write(f"{name}:   {damage.plan(report.findings)}\n")
        if name in recovery.queues:
            out.write(f"{name}:   judged before the commit log's records are written into its files, which "
                      "repairs what they cover: check again once a start has recovered the log\n")
    return EXIT_DAMAGED if damaged else EXIT_USAGE if missing else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("queue_path", metavar="QUEUE_PATH", help="the server's queue path")
    parser.add_argument("queues", nargs="*", metavar="QUEUE", help="queues to check (all when none is named)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """0 when nothing is damaged; 1 when something is (or cannot be read); 2 when the path is not a
    directory or a queue named is not in it (a typo is not damage); 3 while a server holds the path."""
    if not os.path.isdir(args.queue_path):
        print(f"kestrel journal check: {args.queue_path} is not a directory", file=err)
        return EXIT_USAGE
    in_use = lock.holder(args.queue_path)  # named as convert and recover name it
    if in_use is not None:
        print(f"kestrel journal check: {in_use}", file=err)
        return EXIT_IN_USE
    try:
        return check(args.queue_path, args.queues, out)
    except OSError as e:  # the path itself (a start stops on it too), not one queue's files
        print(f"kestrel journal check: cannot read {e.filename or args.queue_path}: {e.strerror or e}",
              file=err)
        return EXIT_DAMAGED
