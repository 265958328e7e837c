"""How a group commit round reaches the disk: its variants, each a `FsyncMany`.

`group_commit.py` runs the rounds; a round's fsyncs are issued by OS threads (the default),
Linux native AIO (`aio_fsync.py`), one syncfs(2) of the file system (`syncfs.py`) or the compiled
helper (`_fsync_many.c`), whose completion a greenlet waits for on an eventfd (`eventfd.py`).
"""

from __future__ import annotations

from typing import Protocol


class FsyncMany(Protocol):
    """Issues a round's fsyncs concurrently: for each descriptor, None or the error of its fsync."""

    def fsync_all(self, fds: list[int]) -> list[OSError | None]: ...
