"""`python -m storage.dump FILE...`: print a journal's records, one per line, with their offsets.

For operators looking at a damaged or surprising journal; it never changes the file.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from storage.codec import describe
from storage.errors import CorruptJournalError
from storage.journal import RecordReader, torn_tail_damage


def dump(path: str, out: TextIO = sys.stdout) -> int:
    """Print every record of `path`; return 0, or 1 when the file is torn or corrupt."""
    reader = RecordReader(path, check_sizes=True)
    write = out.write
    try:
        count = 0
        for offset, record in reader:
            write(f"{offset:>12}  {describe([record])}\n")
            count += 1
        left = reader.leftover()
        if left:
            damage = torn_tail_damage(path, reader.offset)
            if damage is not None:
                write(f"{reader.offset:>12}  corrupt: {damage}\n")
            else:
                write(f"{reader.offset:>12}  torn: {left} bytes of an incomplete record\n")
            return 1
        write(f"{path}: {count} records, {reader.offset} bytes\n")
        return 0
    except CorruptJournalError as e:
        write(f"{e.offset:>12}  corrupt: {e.reason}\n")
        return 1
    finally:
        reader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m storage.dump", description=__doc__)
    parser.add_argument("files", nargs="+", help="journal files to print")
    args = parser.parse_args(argv)
    return max(dump(path) for path in args.files)


if __name__ == "__main__":
    sys.exit(main())
