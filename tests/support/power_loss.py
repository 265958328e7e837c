"""A power cut, for tests: each file keeps what an fsync of it covered and a prefix of the rest, and
each folder the names an fsync of it saw.

The model, as ext4 and xfs behave when no journal commit of something else happens to carry a change:

- A file's bytes are durable as far as the last successful fsync or fdatasync of it reached (its
  size then); a power cut keeps those and `keep` more of what was written after (a torn write).
- A name made in a folder (a creation, a rename into it, a link, a `mkdir`) or taken out of it (an
  unlink, a rename away, an `rmdir`) is durable only once that folder is fsynced. A power cut makes
  each folder what its last fsync saw: names made since are gone, names taken out since are back,
  with the durable bytes of the file they named then (the model keeps a descriptor of each file and
  folder a listing names, so its bytes outlive an unlink and its inode number is not reused). A
  folder's listing is taken before its real fsync, as an fsync running when the power goes may not
  have covered what happened during it.
- What the Disk finds under each root it is given, when it is installed (or `watch`ed), is durable,
  and so is what a power cut leaves. `power_cut` makes a root's tree what a cut now would leave
  (every file in it written anew); `left_by_cut` writes that beside it, changing nothing (a cut at
  each step: tests/support/crash_points.py).

`Disk` wraps `os.fsync` and `os.fdatasync` (every fsync of the engine goes through them under the
threads and manual runtimes, and on the gevent runtime's thread pool; the gevent runtime's C threads
do not), and `os.rename` and `os.replace`, which it keeps from running while it lists a folder: a
listing reads the names and then opens each, and a file renamed in between would be under neither. Files and folders are told apart by inode, on one file system; a symbolic link or anything
but a file or a folder is left as it is.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gevent import monkey

Listing = dict[str, tuple[int, bool]]  # a folder's names -> (inode, whether a folder)


class Disk:
    def __init__(self, *roots: str | Path) -> None:
        self.durable: dict[int, int] = {}  # file inode -> bytes an fsync covered
        self.roots: list[str] = []  # the trees `power_cut` may cut
        self._given = [str(root) for root in roots]
        self._listings: dict[int, tuple[int, Listing]] = {}  # folder inode -> (order taken, names)
        self._held: dict[int, int] = {}  # inode -> a descriptor keeping it (and its number) alive
        self._real: dict[str, Callable[..., None]] = {}
        self._order = itertools.count()
        self._cuts = 0  # power cuts so far: an fsync begun before one is not noted after it
        # A real lock: the gevent runtime's pool threads fsync too, whatever the monkey-patching.
        self._lock = monkey.get_original("threading", "Lock")()

    def install(self) -> Disk:
        for root in self._given:
            self.watch(root)
        for name in ("fsync", "fdatasync"):
            real = self._real[name] = getattr(os, name)
            setattr(os, name, self._wrap(real))
        for name in ("rename", "replace"):
            real = self._real[name] = getattr(os, name)
            setattr(os, name, self._between_listings(real))
        return self

    def uninstall(self) -> None:
        for name, real in self._real.items():
            setattr(os, name, real)
        self._real.clear()
        with self._lock:
            self._cuts += 1  # (an fsync under way notes nothing now)
            for fd in self._held.values():
                os.close(fd)
            self._held.clear()

    def watch(self, root: str | Path) -> None:
        """Take the tree under `root` as durable, as it is now; `power_cut` may then cut it."""
        with self._lock:
            self._take_as_durable(str(root))
            self.roots.append(str(root))

    def _wrap(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            mode, inode, size = (found := os.fstat(fd)).st_mode, found.st_ino, found.st_size
            listing = None
            with self._lock:
                cuts, order = self._cuts, next(self._order)
                if stat.S_ISDIR(mode):
                    listing = self._list(fd)
            real(fd)
            with self._lock:
                if cuts != self._cuts:
                    return
                if listing is not None:
                    if order > self._listings.get(inode, (-1, {}))[0]:
                        self._listings[inode] = (order, listing)
                elif stat.S_ISREG(mode) and self._hold(f"/proc/self/fd/{fd}") is not None:
                    self.durable[inode] = max(self.durable.get(inode, 0), size)
        return sync

    def _between_listings(self, real: Callable[..., None]) -> Callable[..., None]:
        def rename(*args: Any, **kwargs: Any) -> None:
            with self._lock:
                real(*args, **kwargs)
        return rename

    def power_cut(self, path: str, keep: int = 0) -> None:
        """Make the tree under `path` (a root) what a power cut now would leave."""
        with self._lock:
            root = self._root(path)
            self._cuts += 1
            with os.scandir(path) as entries:
                for entry in list(entries):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
            self._fill(path, root, keep)
            self._take_as_durable(path)

    def left_by_cut(self, path: str, into: str, keep: int = 0) -> None:
        """Write at `into` (a new folder) what a power cut now would leave of the tree under `path`
        (a root), which stays as it is."""
        with self._lock:
            os.mkdir(into)
            self._fill(into, self._root(path), keep)

    def _root(self, path: str) -> int:
        if path not in self.roots:
            raise ValueError(f"{path} is not a root of this Disk: give it to Disk() or watch()")
        return os.stat(path).st_ino

    # -- under the lock ---------------------------------------------------------------------------

    def _list(self, folder: int | str) -> Listing:
        """The files and folders in `folder` (a descriptor or a path), each inode held."""
        listing: Listing = {}
        with os.scandir(folder) as entries:
            found = list(entries)
        for entry in found:
            if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                held = self._hold(entry.name, folder) if isinstance(folder, int) else self._hold(entry.path)
                # Gone, or the name made anew, before the fsync: the removal is covered, the new name not.
                if held is not None and held[0] == entry.inode():
                    listing[entry.name] = held
        return listing

    def _hold(self, path: str, folder: int | None = None) -> tuple[int, bool] | None:
        """Keep a descriptor of the file or folder at `path` (if not kept yet): its inode and
        whether a folder; None if it is gone (or is neither)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK, dir_fd=folder)
        except FileNotFoundError:
            return None
        found = os.fstat(fd)
        kept = stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)
        if kept and found.st_ino not in self._held:
            self._held[found.st_ino] = fd
        else:
            os.close(fd)
        return (found.st_ino, stat.S_ISDIR(found.st_mode)) if kept else None

    def _take_as_durable(self, root: str) -> None:
        for folder, _, files in os.walk(root):
            self._listings[os.stat(folder).st_ino] = (next(self._order), self._list(folder))
            for name in files:
                st = os.lstat(os.path.join(folder, name))
                self.durable[st.st_ino] = st.st_size

    def _fill(self, folder: str, inode: int, keep: int) -> None:
        """Put in `folder` what the folder of inode `inode` held at its last fsync, each file with
        the bytes an fsync of it covered and `keep` more (from the descriptor kept of it)."""
        for name, (held, is_folder) in self._listings.get(inode, (0, {}))[1].items():
            path = os.path.join(folder, name)
            if is_folder:
                os.mkdir(path)
                self._fill(path, held, keep)
            else:
                fd = self._held[held]
                size = min(os.fstat(fd).st_size, self.durable.get(held, 0) + keep)
                Path(path).write_bytes(os.pread(fd, size, 0))

    def __enter__(self) -> Disk:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
