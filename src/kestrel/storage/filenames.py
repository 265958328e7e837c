"""Every file-name rule of the queue path, for Kestrel 2 journals and Kestrel 3 files alike.

Kestrel 2 journals of queue `q` (the format document): `q` is the live journal; `q.<ms>` are rotated
journals, replayed in timestamp order before the live one; `q.<ms>.pack` is a finished pack that
makes every rotated journal with a timestamp at or below its own dead; `q~~<ms>` is a pack being
written. Anything with `~~` is a temporary, removed at start-up.

Every other file of the server's is kept in one directory of its own, `<queue_path>/.kestrel/`, which
Kestrel's scans of the queue path never read (docs/durability.md, "Files Kestrel can open"): the
lock, the Thrift read-id floor, a conversion's record, each queue's manifest `q.manifest`
(src/kestrel/storage/manifest.py, written as `q~~manifest-<writer>`), the commit log's directory,
and the copies that damage handling sets aside, `aside/<file>.<label>-<ms>`.

Kestrel 3 files of queue `q`: `q.<number>` are writer journals; `q.read.<reader>` holds one reader's
checkpoint (`q.read.` for the default reader); `q~~read.<reader>` is a checkpoint being written.
"""

from __future__ import annotations

import os
import re

from kestrel.storage.errors import InvalidQueueName

TEMPORARY_MARK = "~~"
READER_INFIX = ".read."
MAX_FILE_NAME_BYTES = 255
_ROTATED = re.compile(r"^(?P<name>[^.~]+)\.(?P<ts>\d+)$")
_PACKED = re.compile(r"^(?P<name>[^.~]+)\.(?P<ts>\d+)\.pack$")
# Characters that would let a name leave the queue path, collide with another file's suffix, or be
# taken for a temporary; with why. Kestrel 3 names (new files, no existing queues to keep loading)
# also refuse a backslash and lone surrogates.
_FORBIDDEN = {"/": "it is a path separator", "~": "it marks temporary files",
              ".": "it is reserved for journal file suffixes", "\0": "it cannot be in a file name"}
_FORBIDDEN_KESTREL3 = {**_FORBIDDEN, "\\": "it is a path separator"}


def _check_characters(what: str, name: str, forbidden: dict[str, str], surrogates: bool) -> None:
    """The one character rule of every name that becomes part of a file name."""
    for char, why in forbidden.items():  # in the table's order: a path separator is named first
        if char in name:
            raise InvalidQueueName(f"{what} name {name!r} contains {char!r}, which is not allowed: {why}")
    if any(c.isspace() or ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in name):  # C0, DEL and C1
        raise InvalidQueueName(f"{what} name {name!r} contains whitespace or a control character")
    if surrogates and any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        raise InvalidQueueName(f"{what} name {name!r} contains a lone surrogate, not a character")


# ---------------------------------------------------------------------------------------------
# Queue names (a queue's name is its live journal's file name)

# Room left in a 255-byte file name for ".<13-digit ms>.pack" and similar suffixes.
MAX_NAME_BYTES = 200


def check_queue_name(name: str) -> None:
    """Refuse names that could not be a journal file name, saying why.

    Raises InvalidQueueName.
    """
    if not name:
        raise InvalidQueueName("queue name is empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidQueueName(f"queue name is longer than {MAX_NAME_BYTES} bytes")
    _check_characters("queue", name, _FORBIDDEN, surrogates=False)
    if "+" in name:
        parent, _, child = name.partition("+")
        if not parent or not child or "+" in child:
            raise InvalidQueueName(
                f"queue name {name!r}: '+' is only allowed once, as parent+child for a fanout queue")


# ---------------------------------------------------------------------------------------------
# Kestrel 2 journals


def rotated_name(queue: str, timestamp: int) -> str:
    return f"{queue}.{timestamp}"


def pack_name(queue: str, timestamp: int) -> str:
    return f"{queue}.{timestamp}.pack"


def pack_temporary_name(queue: str, timestamp: int) -> str:
    return f"{queue}{TEMPORARY_MARK}{timestamp}"


CONVERSION_MARK = TEMPORARY_MARK + "convert-"


def conversion_temporary_name(queue: str, final: str) -> str:
    """`<queue>~~convert-<suffix>`: file `final` (`<queue>` or `<queue><suffix>`) of `queue` written
    by `kestrel journal convert` before it is renamed into place. The queue's name is not repeated
    after the mark: a name of 200 bytes and its suffix then stay within a file name's 255."""
    if not final.startswith(queue):
        raise ValueError(f"{final!r} is no file of queue {queue!r}")
    return _file_name(f"{queue}{CONVERSION_MARK}{final[len(queue):]}")


def is_temporary(file_name: str) -> bool:
    return TEMPORARY_MARK in file_name


def temporary_prefix(queue: str) -> str:
    """Every temporary of `queue` (a pack or a Kestrel 3 checkpoint being written) starts so."""
    return queue + TEMPORARY_MARK


def parse_journal_name(file_name: str) -> tuple[str, str, int] | None:
    """("live" | "rotated" | "pack", queue, timestamp) for a Kestrel 2 journal, else None."""
    if is_temporary(file_name):
        return None
    m = _ROTATED.match(file_name)
    if m:
        return "rotated", m.group("name"), int(m.group("ts"))
    m = _PACKED.match(file_name)
    if m:
        return "pack", m.group("name"), int(m.group("ts"))
    if "." not in file_name and "~" not in file_name:
        return "live", file_name, 0
    return None


def live_path(queue_path: str, queue: str) -> str:
    """The live journal: the queue's name itself."""
    return os.path.join(queue_path, queue)


def rotated_path(queue_path: str, queue: str, timestamp: int) -> str:
    return os.path.join(queue_path, rotated_name(queue, timestamp))


# ---------------------------------------------------------------------------------------------
# Kestrel 3 files


def check_name_part(what: str, name: str, allow_empty: bool = False) -> None:
    """Refuse a queue or reader name that could make a file name outside the queue path.

    Raises InvalidQueueName saying which rule the name broke.
    """
    if not name and not allow_empty:
        raise InvalidQueueName(f"{what} name is empty")
    _check_characters(what, name, _FORBIDDEN_KESTREL3, surrogates=True)


def _file_name(name: str) -> str:
    if len(name.encode("utf-8", "surrogatepass")) > MAX_FILE_NAME_BYTES:
        raise InvalidQueueName(f"file name {name!r} is longer than {MAX_FILE_NAME_BYTES} bytes")
    return name


def writer_file_name(queue: str, number: int) -> str:
    """`<queue>.<number>`: one segment of the queue's writer journal."""
    check_name_part("queue", queue)
    if number < 0:
        raise ValueError(f"writer file number {number!r} is negative")
    return _file_name(f"{queue}.{number}")


def reader_file_name(queue: str, reader: str = "") -> str:
    """`<queue>.read.<reader>`: the reader's checkpoint (`<queue>.read.` for the default reader)."""
    check_name_part("queue", queue)
    check_name_part("reader", reader, allow_empty=True)
    return _file_name(f"{queue}{READER_INFIX}{reader}")


def checkpoint_temporary_name(queue: str, reader: str = "") -> str:
    return _file_name(f"{temporary_prefix(queue)}{reader_file_name(queue, reader)[len(queue) + 1:]}")


def writer_file_number(queue: str, file_name: str) -> int | None:
    """The number of `queue`'s writer journal called `file_name`, or None if it is not one."""
    prefix = queue + "."
    rest = file_name[len(prefix):]
    if file_name.startswith(prefix) and rest.isascii() and rest.isdigit():
        return int(rest)
    return None


def checkpoint_of(file_name: str) -> tuple[str, str] | None:
    """The queue and reader (`""`: the queue's own) whose checkpoint is called `file_name`, or None
    if it is no reader checkpoint."""
    queue, infix, _ = file_name.partition(READER_INFIX)
    reader = reader_of(queue, file_name) if queue and infix else None
    return None if reader is None else (queue, reader)


def reader_of(queue: str, file_name: str) -> str | None:
    """The reader whose checkpoint of `queue` is called `file_name`, or None if it is not one."""
    prefix = queue + READER_INFIX
    if file_name.startswith(prefix) and "." not in file_name[len(prefix):] and "~" not in file_name:
        return file_name[len(prefix):]
    return None


# ---------------------------------------------------------------------------------------------
# The server's own files, in a directory of their own

# Kestrel 2.4.1 takes every file of the queue path for a queue's journal (`<queue>.<suffix>`, the
# suffix parsed as a number; a file starting with a dot for a queue with an empty name), and skips
# directories when it looks for queue names. A directory whose name starts with a dot is neither a
# queue name nor `<queue>.` of any queue: nothing in it is read.
OWN_DIRECTORY = ".kestrel"
LOCK_NAME = "lock"
READ_IDS_NAME = "read_ids"
STATUS_NAME = "status"  # the server's status, where `status_file` is left at its default
CONVERT_NAME = "convert"
COMMIT_LOG_NAME = "commit-log"
ASIDE_NAME = "aside"
MANIFEST_SUFFIX = ".manifest"


def own_path(queue_path: str, *names: str) -> str:
    """A path in the server's own directory of `queue_path`."""
    return os.path.join(queue_path, OWN_DIRECTORY, *names)


def manifest_name(queue: str) -> str:
    """`<queue>.manifest`: the record of the queue's files (no queue name holds a dot)."""
    return queue + MANIFEST_SUFFIX


def manifest_temporary_name(queue: str, writer: str = "") -> str:
    """`<queue>~~manifest<writer>`: `writer` tells apart threads that might write at once."""
    return f"{queue}{TEMPORARY_MARK}manifest{writer}"


def queue_of_manifest(file_name: str) -> str | None:
    """The queue whose manifest is called `file_name`, or None if it is not one."""
    queue = file_name.removesuffix(MANIFEST_SUFFIX)
    if queue == file_name or not queue or "." in queue or TEMPORARY_MARK in queue:
        return None
    return queue


def set_aside_path(queue_path: str, file_name: str, label: str, stamp: int) -> str:
    """`.kestrel/aside/<file>.<label>-<ms>`: where damage handling keeps a copy of what it cut,
    replaced or set aside from the file `file_name` of the queue path."""
    return own_path(queue_path, ASIDE_NAME, f"{file_name}.{label}-{stamp}")
