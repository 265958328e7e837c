"""Pipelined runs: consecutive plain `set`s to one queue, or plain `get`s of one queue, in a receive
buffer, so that a burst costs one batch put or one batch get rather than a command's Python each.

Only the exact common shapes are recognised: `set <key> <flags> <exptime> <bytes>[ noreply]` with
its data and CRLF complete in the buffer, and `get <key>` without options; lines end in CRLF and stay
within `max_line` (the '\\n' at most `max_line` bytes after the line's start), items within
`max_item` (the connection's `max_frame_size`), keys are printable ASCII. A run ends before the first
command of another shape, key or exptime; `commands.parse_line` reads that one, as it reads every
line a run does not take, and gives the same command for every line a run does take.

`_scan.c` is the compiled twin of the three functions here; these are the reference its tests
compare it with, and what serves where the build had no C compiler.
"""

from __future__ import annotations

import re

from kestrel.service.memcache.commands import MAX_ITEM_BYTES

RUN_LIMIT = 1024  # commands in one run: a run's work stays well within a connection's turn

_SET = re.compile(rb"set ([\x21-\x7e]+) ([0-9]{1,10}) ([0-9]{1,10}) ([0-9]{1,10})( noreply)?\r\n")
_GET = re.compile(rb"get ([\x21-\x2e\x30-\x7e]+)\r\n")  # no '/': a get with options is not plain
_U32 = 2**32 - 1


def _set_at(buf: bytes | bytearray, pos: int, end: int, max_line: int,
            max_item: int) -> tuple[bytes, int, int, bool, int] | None:
    """A plain set at `pos` with its data: (key, exptime, where its data starts, noreply, size)."""
    line = _SET.match(buf, pos, end)
    if line is None or line.end() - 1 - pos > max_line:
        return None
    key, flags, exptime, size, noreply = line.groups()
    data, length = line.end(), int(size)
    if (int(flags) > _U32 or int(exptime) > _U32 or length > MAX_ITEM_BYTES or length > max_item
            or data + length + 2 > end or buf[data + length:data + length + 2] != b"\r\n"):
        return None
    return key, int(exptime), data, noreply is not None, length


def scan_sets_python(buf: bytes | bytearray, pos: int, end: int, max_line: int, max_item: int,
                     limit: int) -> tuple[bytes, int, list[bytes], bytes, int] | None:
    """The run of plain sets at `pos` to one key with one exptime, at most `limit` of them:
    (key, exptime, each item's data, a byte per set: 1 if it wants a reply else 0, where the run
    ends); None if the command at `pos` is not a plain set."""
    first = _set_at(buf, pos, end, max_line, max_item) if limit > 0 else None
    if first is None:
        return None
    key, exptime = first[:2]
    datas: list[bytes] = []
    answered = bytearray()
    found: tuple[bytes, int, int, bool, int] | None = first
    while found is not None and found[:2] == (key, exptime):
        data, noreply, size = found[2:]
        datas.append(bytes(buf[data:data + size]))
        answered.append(0 if noreply else 1)
        pos = data + size + 2
        found = _set_at(buf, pos, end, max_line, max_item) if len(datas) < limit else None
    return key, exptime, datas, bytes(answered), pos


def scan_gets_python(buf: bytes | bytearray, pos: int, end: int, max_line: int,
                     limit: int) -> tuple[bytes, int, int] | None:
    """The run of plain gets of one key at `pos`, at most `limit`: (key, how many, where the run
    ends); None if the command at `pos` is not a plain get."""
    line = _GET.match(buf, pos, end) if limit > 0 else None
    if line is None or line.end() - 1 - pos > max_line:
        return None
    text = line.group()
    count = 1
    pos = line.end()
    while count < limit and pos + len(text) <= end and buf.startswith(text, pos):
        count += 1
        pos += len(text)
    return line.group(1), count, pos


def values_python(key: bytes, datas: list[bytes], misses: int) -> bytes:
    """The replies of a run of gets: a VALUE block then END per item found, then END per miss."""
    found = [b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (key, len(data), data) for data in datas]
    return b"".join(found) + b"END\r\n" * misses


try:
    from kestrel.service.memcache._scan import scan_gets, scan_sets, values
except ImportError:  # built without a C compiler: the Python functions
    scan_sets, scan_gets, values = scan_sets_python, scan_gets_python, values_python

__all__ = ["RUN_LIMIT", "scan_gets", "scan_gets_python", "scan_sets", "scan_sets_python", "values",
           "values_python"]
