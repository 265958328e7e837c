"""`kestrel journal dump FILE...` (or `python -m kestrel.storage.tools.dump`): print a journal's
records with offsets.

Reads either format: a Kestrel 3 writer journal or reader checkpoint is told by its 4-byte header
(neither header starts with a Kestrel 2 opcode), anything else is read as a Kestrel 2 journal. With
`--queue NAME DIR` it prints instead the items a start-up would load for that queue from its files
in DIR, in the format they are in: a Kestrel 2 queue's journals replayed, a Kestrel 3 queue's
writer files past its reader's checkpoint (`NAME` or `NAME+READER`). For operators looking at a
damaged or surprising journal; it never changes a file.

A running server rotates, packs and deletes a queue's files while `--queue` reads them: it reads them
until they held still through a reading (src/kestrel/storage/settled_read.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from kestrel.storage import commit_log, disk, torn_tail
from kestrel.storage.errors import CorruptJournalError, InvalidQueueName
from kestrel.storage.filenames import check_queue_name
from kestrel.storage.formats import KESTREL3, queues_on_disk
from kestrel.storage.kestrel2.codec import describe
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.kestrel2.replay import replay_queue
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3 import files as kestrel3_files
from kestrel.storage.settled_read import FilesKeptChanging, queue_files, read_settled


def dump(path: str, out: TextIO = sys.stdout) -> int:
    """Print every record of `path`, then a line naming the file; return 0, or 1 if it is torn or corrupt."""
    with os.fdopen(disk.open_file(path, os.O_RDONLY), "rb") as f:  # a FIFO refused, not waited on
        header = f.read(k3.MAGIC_SIZE)
    if k3.kind_of(header) is not None:
        k3_reader = kestrel3_files.RecordReader(path)
        out.write(f"{0:>12}  header: Kestrel 3 {k3_reader.kind.title} ({k3_reader.kind.value.hex(' ')})\n")
        return _print_records(path, k3_reader, k3.describe, lambda: k3_reader.torn, out)
    k2_reader = JournalReader(path, check_sizes=True)

    def k2_torn() -> str | None:
        left = k2_reader.leftover()
        if not left:
            return None
        damage = k2_reader.tail_damage(last=True)
        if damage is not None:  # a damaged size field, not a torn write
            raise damage
        return f"{left} bytes of an incomplete record"

    return _print_records(path, k2_reader, lambda r: describe([r]), k2_torn, out)


def _print_records(path: str, reader: JournalReader | kestrel3_files.RecordReader,
                   show: Callable[[Any], str], torn: Callable[[], str | None], out: TextIO) -> int:
    write = out.write
    count = 0
    try:
        for offset, record in reader:
            write(f"{offset:>12}  {show(record)}\n")
            count += 1
        why = torn()
        if why:
            write(f"{reader.offset:>12}  torn: {why}\n")
            write(f"{path}: torn record at offset {reader.offset} after {count} records\n")
            return 1
        write(f"{path}: {count} records, {reader.offset} bytes\n")
        return 0
    except CorruptJournalError as e:
        write(f"{e.offset:>12}  corrupt: {e.reason}\n")
        write(f"{path}: corrupt record at offset {e.offset} after {count} records\n")
        return 1
    finally:
        reader.close()


def say_if_pending(queue_paths: list[str], err: TextIO) -> None:
    """Say so where a commit log holds records (the journals may lack what it holds), or could not
    be read to tell."""
    for queue_path in dict.fromkeys(queue_paths):
        if (note := commit_log.pending_note(queue_path)) is not None:
            print(f"note: {note}", file=err)


def dump_files(paths: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Print each file in turn; return 0, or 1 if any was torn, corrupt or unreadable."""
    say_if_pending([os.path.dirname(os.path.abspath(p)) for p in paths], err)
    status = 0
    for path in paths:
        try:
            status = max(status, dump(path, out))
        except OSError as e:
            print(f"{path}: cannot read: {e.strerror or e}", file=err)
            status = 1
    return status


def dump_queue(queue_path: str, queue: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Print the queue as a start-up would load it, open reads first; return 0, 1 if it is damaged,
    has no files, or (Kestrel 3) has no such reader, 2 if `queue` is no queue's name."""
    try:
        check_queue_name(queue)
    except InvalidQueueName as e:
        print(f"--queue: {e}", file=err)
        return 2
    say_if_pending([queue_path], err)
    try:
        kestrel3 = queues_on_disk(queue_path).get(queue.partition("+")[0]) == KESTREL3
        owner = queue.partition("+")[0] if kestrel3 else queue  # a Kestrel 3 reader's files are its unit's
        if not queue_files(queue_path, owner):
            print(f"{queue_path}: holds no journal of queue {owner!r}", file=err)
            return 1
        if kestrel3:
            return _dump_kestrel3_queue(queue_path, queue, out, err)
        state = read_settled(queue_path, queue, lambda: replay_queue(queue_path, queue))
        if state.torn_tail is not None:
            print(f"note: {torn_tail.cut_note(*state.torn_tail)}", file=err)
    except CorruptJournalError as e:
        print(f"{e.path}: corrupt record at offset {e.offset}: {e.reason}", file=err)
        return 1
    except OSError as e:
        print(f"{queue_path}: cannot read: {e.strerror or e}", file=err)
        return 1
    except FilesKeptChanging as e:
        print(e, file=err)
        return 1
    for position, item in enumerate(state.restart_order()):
        state_of = f"open xid={item.xid}" if position < len(state.opens) else "queued"
        _print_item(out, position, state_of, item.add_time, item.expiry, item.data)
    out.write(f"{queue}: {len(state.opens)} open reads, {len(state.items)} items\n")
    return 0


def _dump_kestrel3_queue(queue_path: str, queue: str, out: TextIO, err: TextIO) -> int:
    """The items of a Kestrel 3 queue's reader (`unit+reader`, or the unit's own) that its checkpoint
    has not consumed: its open reads are not kept on disk, so they are all queued at a start."""
    unit, _, reader = queue.partition("+")
    if reader and reader not in kestrel3_files.list_queue_files(queue_path, unit).readers:
        print(f"{queue_path}: Kestrel 3 queue {unit!r} has no reader {reader!r}", file=err)
        return 1

    def read() -> tuple[list[k3.Put], list[tuple[str, int]]]:
        path = kestrel3_files.list_queue_files(queue_path, unit).readers.get(reader)
        checkpoint = kestrel3_files.read_checkpoint(path, repair=False)
        torn: list[tuple[str, int]] = []
        pending = list(kestrel3_files.pending_items(queue_path, unit, checkpoint,
                                                    torn_tail=lambda at, offset: torn.append((at, offset))))
        return pending, torn

    pending, torn = read_settled(queue_path, unit, read)
    for at, offset in torn:
        print(f"note: {torn_tail.cut_note(at, offset)}", file=err)
    for position, put in enumerate(pending):
        _print_item(out, position, f"queued id={put.id}", put.add_time, put.expire_time, put.data)
    out.write(f"{queue}: {len(pending)} items (Kestrel 3)\n")
    return 0


def _print_item(out: TextIO, position: int, state_of: str, add_time: int, expiry: int | None,
                data: bytes) -> None:
    out.write(f"{position:>12}  {state_of} add={add_time} expire={expiry or '-'} "
              f"{len(data)}:{data.decode('utf-8', 'replace')}\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="journal files to print (either format), or with --queue the queue path")
    parser.add_argument("--queue", metavar="NAME",
                        help="print the items of queue NAME as a start-up would load them")


def run(args: argparse.Namespace) -> int:
    if args.queue is None:
        return dump_files(args.files)
    if len(args.files) != 1:
        print("--queue takes exactly one directory: the queue path", file=sys.stderr)
        return 2
    return dump_queue(args.files[0], args.queue)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kestrel.storage.tools.dump", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
