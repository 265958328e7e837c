"""A SIGKILL or a power cut at every step, for tests: a copy of a queue path as it stands before
each change of its names (a file created, renamed, replaced or deleted), so that a test can start on
each; with a `Disk` (tests/support/power_loss.py), a copy of what a power cut would leave there
instead, taken before each fsync under the queue path too.

`CrashPoints` wraps `os.open` (when it creates), `os.rename`, `os.replace` and `os.unlink`; before
each call on a path under the queue path it copies the queue path, the server's own directory
included, to a numbered folder, with the call and what the test's `note` says then. A SIGKILL keeps
every write already made (the kernel holds them), so each copy is what a kill at that instant
leaves (fsyncs change nothing a test of kills looks at: `skip_fsync` saves their time). A copy
is exact only while nothing else changes the files: the engine's blocking calls run inline
(`InlineRuntime`), background work on greenlets of this thread. A power cut keeps only what the
`Disk` saw fsynced, its names included (fsyncs may then be skipped too: the `Disk` wraps whatever
`os.fsync` is when it is installed).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kestrel.storage.fsync.group_commit import GroupCommit
from kestrel.storage.runtime import GeventRuntime
from tests.support.power_loss import Disk

T = TypeVar("T")


class InlineRuntime(GeventRuntime):
    """Greenlets for background work (rotated files sealed, packs), and blocking calls in the
    calling greenlet: every file operation runs in this thread, one at a time. Each journal syncs
    alone (no fsync round waiting for a turn of the loop)."""

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def group_commit(self) -> GroupCommit | None:
        return None


@dataclass
class Crash:
    path: str  # the copy of the queue path
    step: str  # the call it was taken before, e.g. "rename q.1.pack -> q.1"
    note: Any  # what the test's `note` returned then (what may be found there)


class CrashPoints:
    """Copies of `queue_path` into `into/<n>` before each change of a name under it."""

    def __init__(self, queue_path: str, into: str, note: Callable[[], Any],
                 armed: Callable[[], bool] = lambda: True, disk: Disk | None = None) -> None:
        self.queue_path = os.path.abspath(queue_path)
        self.into = into
        self.note = note
        self.armed = armed  # copies are taken only while it says so (after a fault, say)
        self.disk = disk  # copies of what a power cut leaves (the queue path one of its roots), or None
        self.crashes: list[Crash] = []
        self._real: dict[str, Any] = {}
        self._copying = False

    def _mine(self, path: Any) -> bool:
        return isinstance(path, str) and os.path.abspath(path).startswith(self.queue_path + os.sep)

    def _copy(self, step: str) -> None:
        if self._copying or not self.armed():
            return
        self._copying = True
        try:
            copy = os.path.join(self.into, str(len(self.crashes)))
            if self.disk is not None:
                os.makedirs(self.into, exist_ok=True)
                self.disk.left_by_cut(self.queue_path, copy)
            else:
                shutil.copytree(self.queue_path, copy, ignore=shutil.ignore_patterns("lock"))
            self.crashes.append(Crash(copy, step, self.note()))
        finally:
            self._copying = False

    def _name(self, path: str) -> str:
        return os.path.relpath(path, self.queue_path)

    def install(self) -> CrashPoints:
        real = self._real = {name: getattr(os, name) for name in ("open", "rename", "replace", "unlink")}

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_CREAT and self._mine(path) and not os.path.exists(path):
                self._copy(f"create {self._name(path)}")
            result: int = real["open"](path, flags, *args, **kwargs)
            return result

        def move(name: str) -> Callable[..., None]:
            def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
                if self._mine(src):
                    self._copy(f"{name} {self._name(src)} -> {self._name(dst)}")
                real[name](src, dst, *args, **kwargs)
            return call

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if self._mine(path):
                self._copy(f"unlink {self._name(path)}")
            real["unlink"](path, *args, **kwargs)

        def sync(name: str) -> Callable[[int], None]:
            def call(fd: int) -> None:
                path = os.readlink(f"/proc/self/fd/{fd}")
                if self._mine(path) or path == self.queue_path:
                    self._copy(f"{name} {self._name(path)}")
                real[name](fd)
            return call

        os.open = open_  # type: ignore[assignment]
        os.rename = move("rename")
        os.replace = move("replace")
        os.unlink = unlink  # type: ignore[assignment]
        if self.disk is not None:
            real.update(fsync=os.fsync, fdatasync=os.fdatasync)
            os.fsync, os.fdatasync = sync("fsync"), sync("fdatasync")
        return self

    def uninstall(self) -> None:
        for name, real in self._real.items():
            setattr(os, name, real)
        self._real = {}

    def __enter__(self) -> CrashPoints:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


def skip_fsync(monkeypatch: Any) -> None:
    """No fsync reaches the disk for the rest of the test (with pytest's `monkeypatch`): a kill
    keeps what the kernel holds, fsynced or not; only a power cut needs them."""
    for name in ("fsync", "fdatasync"):
        monkeypatch.setattr(os, name, lambda fd: None)
