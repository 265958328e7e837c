"""The server's status (Up, ReadOnly, Quiescent), persisted in a status file across restarts."""

from __future__ import annotations

import enum
import errno
import os
from collections.abc import Callable

import structlog

from kestrel.storage import disk, filenames
from kestrel.storage.errors import KestrelError, RefusedByStatus
from kestrel.storage.runtime import DEFAULT_RUNTIME, Runtime, Timer

log = structlog.get_logger("kestrel.status")

MAX_STATUS_BYTES = 64  # what a status file holds: one status's name and a newline


class UnknownStatus(KestrelError, ValueError):
    """Raised when a status name or number is not one of Up, ReadOnly, Quiescent."""


class StatusChangePending(RefusedByStatus):
    """Raised when the status is changed while an earlier change is still in its grace period."""


class Status(enum.IntEnum):
    """Values as in kestrel.thrift's Status enum; a higher value allows more."""

    NOT_CONFIGURED = 0
    QUIESCENT = 1
    READ_ONLY = 2
    UP = 3

    @classmethod
    def parse(cls, value: str | int) -> Status:
        """The one reader of statuses: a name (`up`, `readonly`, `read_only`, `ReadOnly`,
        `quiescent`: the config, the status file, memcache) or Thrift's number."""
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str):
            key = value.strip().lower().replace("_", "").replace("-", "")
            for status, names in _NAMES.items():
                if key in names:
                    return status
        raise UnknownStatus(f"unknown status {value!r} (expected up, readonly or quiescent)")

    @property
    def label(self) -> str:
        return {Status.UP: "Up", Status.READ_ONLY: "ReadOnly", Status.QUIESCENT: "Quiescent",
                Status.NOT_CONFIGURED: "NotConfigured"}[self]


_NAMES = {Status.UP: ("up",), Status.READ_ONLY: ("readonly",), Status.QUIESCENT: ("quiescent",)}


def read_status_file(path: str) -> Status | None:
    """The status `path` holds; None when there is no file or it holds nothing. Raises OSError (a
    FIFO or a device in its place too: refused, never waited on) and UnknownStatus when it holds
    anything else: then it is no status file, and no status change may replace it."""
    try:
        with disk.open_to_read(path) as f:
            held = f.read(MAX_STATUS_BYTES + 1)
    except FileNotFoundError:
        return None
    if not held.strip():
        return None
    try:
        return Status.parse(held.decode("utf-8", "replace") if len(held) <= MAX_STATUS_BYTES else "")
    except UnknownStatus:
        shown = repr(held[:24]) + ("..." if len(held) > 24 else "")
        raise UnknownStatus(f"it holds {shown}, not a status (up, readonly or quiescent)") from None


def status_file_problem(path: str, queue_path: str) -> OSError | None:
    """Why `path` cannot be the status file, from what is there now (reads only). Any client may
    change the status, which replaces the file: a mistaken path (a journal, the config file, a
    device) was replaced at the first change. Beside the journals, where every name is a queue's, it
    is refused even before it exists."""
    if os.path.dirname(os.path.realpath(path)) == os.path.realpath(queue_path):
        return OSError(errno.EINVAL, "in the queue path beside the journals, where names are queues': keep "
                       f"it in {filenames.own_path(queue_path, '')} (the default) or outside the queue path",
                       path)
    if os.path.isdir(path):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    try:
        read_status_file(path)
    except UnknownStatus as unknown:
        return OSError(errno.EINVAL, f"{unknown}: not a status file, which a status change would replace",
                       path)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no file, or no directory where its directory should be: the start's probe says so
    except OSError as error:
        return OSError(error.errno, error.strerror, path)
    return None


class StatusKeeper:
    """Holds the current status and enforces it.

    When the status becomes more restrictive, the old one is still enforced for the grace period,
    so that clients watching the status can stop in time. The grace period runs on `runtime`'s
    clock and timer.
    """

    def __init__(self, status_file: str | None, default: Status, grace_period_ms: int,
                 runtime: Runtime = DEFAULT_RUNTIME) -> None:
        self.status_file = status_file
        self.grace_period_ms = grace_period_ms
        self.runtime = runtime
        self._grace: Timer | None = None
        self._subscribers: list[Callable[[Status, Status], None]] = []
        self._grace_ends = 0.0
        # What the enforced status allows, kept beside it (`enforced`) for every request's check: a
        # flag read, where comparing two `IntEnum`s is a call of Python's comparison (about 110
        # instructions a check).
        self.writes = self.reads = True
        self._enforced = Status.UP
        if status_file is None:
            self.current = Status.NOT_CONFIGURED
            self.enforced = Status.UP
            return
        self.current = self._read() or default
        self.enforced = self.current

    def _read(self) -> Status | None:
        assert self.status_file is not None
        try:
            return read_status_file(self.status_file)
        except (OSError, ValueError) as e:
            log.warning("cannot read the status file; using the default status", file=self.status_file,
                        error=str(e))
            return None

    def set(self, status: Status) -> None:
        """Change the status and persist it.

        Raises RefusedByStatus when no status file is configured, StatusChangePending while an earlier
        change is still in its grace period (setting that same status again is a no-op), KestrelError
        when the status file cannot be written (the status stays as it was). The file is on disk
        before the change takes effect: a status set survives a power cut.
        """
        if self.status_file is None:
            raise RefusedByStatus("server status is not configured (no status_file)")
        if status == Status.NOT_CONFIGURED:
            raise RefusedByStatus("cannot set the status to NOT_CONFIGURED")
        if self._grace is not None:
            if status == self.current:
                return
            left_ms = max(round((self._grace_ends - self.runtime.clock.monotonic()) * 1000), 0)
            raise StatusChangePending(
                f"cannot change the status to {status.label}: the change from {self.enforced.label} to "
                f"{self.current.label} is still in its grace period ({left_ms} ms left)")
        try:
            disk.replace_file(self.status_file, f"{status.label}\n".encode(),
                              self.status_file + filenames.TEMPORARY_MARK)
        except OSError as e:
            raise KestrelError(f"cannot write the status file {self.status_file}: {e.strerror or e}; "
                               f"the status stays {self.current.label}") from None
        previous, self.current = self.current, status
        log.info("server status changed", status=status.label, previous=previous.label)
        if status < self.enforced and self.grace_period_ms > 0:
            self._grace_ends = self.runtime.clock.monotonic() + self.grace_period_ms / 1000.0
            self._grace = self.runtime.call_later(self.grace_period_ms / 1000.0, self._end_grace)
        else:
            self.enforced = status
        for callback in self._subscribers:
            callback(previous, status)

    @property
    def enforced(self) -> Status:
        """The status whose refusals apply: the current one, or during a grace period the one before."""
        return self._enforced

    @enforced.setter
    def enforced(self, status: Status) -> None:
        self._enforced = status
        self.writes = status >= Status.UP
        self.reads = status >= Status.READ_ONLY

    def subscribe(self, callback: Callable[[Status, Status], None]) -> None:
        """Call `callback(previous, current)` after every change, whichever protocol made it.

        It runs at once, before the grace period, so that watchers (the ZooKeeper server sets) can
        tell clients before a stricter status bites. It must not block.
        """
        self._subscribers.append(callback)

    def _end_grace(self) -> None:
        self._grace = None
        self.enforced = self.current

    def check_write(self, operation: str) -> None:
        """Puts, flushes and deletes need Up."""
        if not self.writes:
            raise RefusedByStatus(f"{operation} refused: server is {self.enforced.label}")

    def check_read(self, operation: str) -> None:
        """Gets, peeks and aborts need at least ReadOnly."""
        if not self.reads:
            raise RefusedByStatus(f"{operation} refused: server is {self.enforced.label}")
