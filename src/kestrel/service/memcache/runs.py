"""Pipelined runs: consecutive plain `set`s to one queue, or plain `get`s of one queue, in a receive
buffer, found in one compiled step (src/kestrel/service/memcache/_scan.c) so that a burst costs one
put or one get rather than a command's Python each.

The scanner recognises only the exact common shapes: `set <key> <flags> <exptime> <bytes>[ noreply]`
with its data and CRLF complete in the buffer, and `get <key>` without options; lines end in CRLF
and stay within `max_line` (the '\\n' at most `max_line` bytes after the line's start), items within
`max_item` (the connection's `max_frame_size`), keys are printable ASCII. A run ends before the
first command of another shape, key or exptime. Every line is `commands.parse_line`'s to read: it
reads each line no run takes, and it is the reference the scanner's runs are checked against
(tests/memcache/test_memcache_runs.py). Where the build had no C compiler there is no scanner
(`scan_sets` and `scan_gets` are None): each command is parsed alone, a set being a put of one.

`values` lays out the replies of a run of gets; `values_python` is its reference and stands in for
it without a compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

RUN_LIMIT: Final = 1024  # commands in one run: a run's work stays well within a connection's turn


def values_python(key: bytes, datas: list[bytes], misses: int) -> bytes:
    """The replies of a run of gets: a VALUE block then END per item found, then END per miss."""
    found = [b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (key, len(data), data) for data in datas]
    return b"".join(found) + b"END\r\n" * misses


ScanSets = Callable[[bytearray, int, int, int, int, int], tuple[bytes, int, list[bytes], bytes, int] | None]
ScanGets = Callable[[bytearray, int, int, int, int], tuple[bytes, int, int] | None]
scan_sets: ScanSets | None
scan_gets: ScanGets | None
try:
    from kestrel.service.memcache._scan import scan_gets, scan_sets, values
except ImportError:  # built without a C compiler: every command parsed alone
    scan_sets = scan_gets = None
    values = values_python

__all__ = ["RUN_LIMIT", "ScanGets", "ScanSets", "scan_gets", "scan_sets", "values", "values_python"]
