"""Ids of Thrift open reads, unique for the life of a queue directory.

A client may retry `confirm(5)` after a restart; if ids started again at 1 that would close some
other client's new read. Ids start from the wall clock (milliseconds shifted left by `SHIFT` bits,
room for a million ids per millisecond of uptime) and from a floor kept in `<queue_path>/.kestrel/read_ids`,
whichever is higher. The floor is reserved a block ahead and written (fsynced) before any id of the
block is handed out, so ids never go backwards even if the clock does. Ids stay positive i64s.
"""

from __future__ import annotations

import structlog

from kestrel.storage import disk, filenames, layout
from kestrel.storage.clock import Clock
from kestrel.storage.errors import KestrelError

log = structlog.get_logger("kestrel.read_ids")

SHIFT = 20
BLOCK = 1 << SHIFT
MAX_ID = (1 << 63) - 1


class ReadIds:
    """Hands out read ids; `take()` is the hot path, a file write every `BLOCK` ids."""

    def __init__(self, queue_path: str, clock: Clock) -> None:
        self.queue_path = queue_path
        self.path = filenames.own_path(queue_path, filenames.READ_IDS_NAME)
        self._next = max(clock.now_ms() << SHIFT, self._stored_floor(), 1)
        self._reserved = self._next
        try:
            self._reserve()
        except KestrelError as e:  # a full disk must not stop the server: ids wait for the floor
            log.warning("read ids are not handed out until their floor can be written", error=str(e))

    def _stored_floor(self) -> int:
        try:
            with disk.open_to_read(self.path) as f:  # a FIFO refused, never waited on
                return int(f.read(64).decode("ascii").strip())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            log.warning("ignoring an unreadable read-id floor; ids start from the clock", path=self.path,
                        error=str(e))
            return 0

    def _reserve(self) -> None:
        reserved = self._reserved + BLOCK
        if reserved > MAX_ID:
            raise OverflowError("read ids are exhausted (past the largest i64)")
        try:
            layout.ensure(self.queue_path)
            disk.replace_file(self.path, f"{reserved}\n".encode(), self.path + filenames.TEMPORARY_MARK)
        except OSError as e:
            raise KestrelError(f"cannot write the read-id floor {self.path}: {e.strerror or e}") from None
        self._reserved = reserved

    def take(self, count: int = 1) -> int:
        """The first of `count` consecutive ids, every one of them under the floor written."""
        first = self._next
        while first + count > self._reserved:
            self._reserve()
        self._next = first + count
        return first
