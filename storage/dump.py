"""`kestrel journal dump FILE...` (or `python -m storage.dump`): print a journal's records with offsets.

Reads either format: a Kestrel 3 writer journal or reader checkpoint is told by its 4-byte header
(neither header starts with a Kestrel 2 opcode), anything else is read as a Kestrel 2 journal. For
operators looking at a damaged or surprising journal; it never changes the file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from storage import kestrel3_codec as k3
from storage import kestrel3_files
from storage.codec import describe
from storage.errors import CorruptJournalError
from storage.journal import RecordReader, torn_tail_damage


def dump(path: str, out: TextIO = sys.stdout) -> int:
    """Print every record of `path`, then a line naming the file; return 0, or 1 if it is torn or corrupt."""
    with open(path, "rb") as f:
        header = f.read(k3.MAGIC_SIZE)
    if k3.kind_of(header) is not None:
        k3_reader = kestrel3_files.RecordReader(path)
        out.write(f"{0:>12}  header: Kestrel 3 {k3_reader.kind.title} ({k3_reader.kind.value.hex(' ')})\n")
        return _print_records(path, k3_reader, k3.describe, lambda: k3_reader.torn, out)
    k2_reader = RecordReader(path, check_sizes=True)

    def k2_torn() -> str | None:
        left = k2_reader.leftover()
        if not left:
            return None
        damage = torn_tail_damage(path, k2_reader.offset)
        if damage is not None:  # a size field one bit off, not a torn write
            raise CorruptJournalError(path, k2_reader.offset, None, damage)
        return f"{left} bytes of an incomplete record"

    return _print_records(path, k2_reader, lambda r: describe([r]), k2_torn, out)


def _print_records(path: str, reader: RecordReader | kestrel3_files.RecordReader,
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


def dump_files(paths: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Print each file in turn; return 0, or 1 if any was torn, corrupt or unreadable."""
    status = 0
    for path in paths:
        try:
            status = max(status, dump(path, out))
        except OSError as e:
            print(f"{path}: cannot read: {e.strerror or e}", file=err)
            status = 1
    return status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="journal files to print (either format)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage.dump", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return dump_files(args.files)


if __name__ == "__main__":
    sys.exit(main())
