"""A power cut, for tests: each file keeps what an fsync covered, and a prefix of the rest.

`Disk` wraps `os.fsync` and `os.fdatasync` (every fsync of the engine goes through them under
the threads and manual runtimes; the gevent runtime's C threads do not) and notes, per inode, how
much of the file the last successful one covered. `power_cut` then cuts every file under a path to
that, keeping `keep` more bytes of what was written after it (a torn write). Renames, creations and
deletions are taken as durable: the engine fsyncs the directory after each that matters.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class Disk:
    def __init__(self) -> None:
        self.durable: dict[int, int] = {}  # inode -> bytes an fsync covered
        self._real: dict[str, Callable[[int], None]] = {}

    def install(self) -> Disk:
        for name in ("fsync", "fdatasync"):
            real = self._real[name] = getattr(os, name)
            setattr(os, name, self._wrap(real))
        return self

    def uninstall(self) -> None:
        for name, real in self._real.items():
            setattr(os, name, real)
        self._real.clear()

    def _wrap(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            stat = os.fstat(fd)
            real(fd)
            if stat.st_mode & 0o170000 == 0o100000:  # a regular file
                self.durable[stat.st_ino] = max(self.durable.get(stat.st_ino, 0), stat.st_size)
        return sync

    def power_cut(self, path: str, keep: int = 0) -> dict[str, int]:
        """Cut every file under `path` as a power cut would; return what each lost, by path."""
        lost = {}
        for folder, _, names in os.walk(path):
            for name in names:
                file = os.path.join(folder, name)
                stat = os.stat(file)
                durable = min(stat.st_size, self.durable.get(stat.st_ino, 0) + keep)
                if durable < stat.st_size:
                    os.truncate(file, durable)
                    lost[file] = stat.st_size - durable
        return lost

    def __enter__(self) -> Disk:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
