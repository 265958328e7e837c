"""The engine's one exception tree. Each protocol maps these to its own wire error in one place."""

from __future__ import annotations

import errno


class KestrelError(Exception):
    """Root of every error the engine raises on purpose."""


# What reading a JSON file of the server's own (a manifest, a conversion record) into its fields
# raises when the file is damaged or was crafted: `Infinity` made into an int, nesting past
# Python's recursion limit and missing or mistyped fields among them. Each is refused as damage.
UNREADABLE_JSON = (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError)


class InvalidQueueName(KestrelError, ValueError):
    """Raised when a queue name could not be a journal file name (slash, squiggle, dot, stray plus)."""


class QueueClosed(KestrelError):
    """Raised when a queue is used after it was closed or deleted."""


class ConfigError(KestrelError, ValueError):
    """Raised when a setting cannot be parsed; the message names the key path. A key holding a control
    character is shown escaped (a newline in one forged a line of the error), and a reason is cut
    at MAX_REASON characters (it quotes the value, which may be a file's worth)."""

    MAX_REASON = 1_000

    def __init__(self, key: str, reason: str) -> None:
        key = key if key.isprintable() else repr(key)
        if len(reason) > self.MAX_REASON:
            reason = f"{reason[:self.MAX_REASON]}... ({len(reason):,} characters)"
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class CorruptJournalError(KestrelError):
    """Raised when a queue's files hold damage: a record that cannot be read and is not a torn tail
    (src/kestrel/storage/torn_tail.py), or a file that does not match the queue's manifest.

    `plan` says what `--salvage` would set aside, file by file (src/kestrel/storage/damage.py),
    when the damage is known before anything moves.
    """

    refusal = "its journal is damaged"  # why a queue refused at start-up for this is not served

    def __init__(self, path: str, offset: int, opcode: int | None, reason: str, plan: str = "") -> None:
        op = "?" if opcode is None else str(opcode)
        super().__init__(f"corrupt journal {path} at offset {offset} (opcode {op}): {reason}")
        self.path = path
        self.offset = offset
        self.opcode = opcode
        self.reason = reason
        self.plan = plan

    def remedy(self) -> str:
        """What to do, for a refused queue's log line and every request to it (the server runs)."""
        plan = self.plan or ("--salvage would keep what precedes the damage and set aside a copy of "
                             "what follows it in that file")
        return (f"restore the damaged file from a copy and restart; or restart with --salvage: {plan} "
                "(what it sets aside is kept in .kestrel/aside/)")


class CommitLogDamaged(CorruptJournalError):
    """Raised for a queue whose records in the commit log recovery cannot place (its journal lacks
    bytes before them, or the log is damaged where they may be): that queue alone is refused, its
    journal kept as it is and its records kept in the log's `held-<queue>` for the next start."""

    def __init__(self, path: str, offset: int, opcode: int | None, reason: str, queue: str = "",
                 held: int = 0, damaged: int = 0) -> None:
        super().__init__(path, offset, opcode, reason)
        self.queue = queue
        self.held = held
        self.damaged = damaged  # damaged spans held with the records: a queue may have none else

    def remedy(self) -> str:
        counts = ", ".join(f"{n} {what}{'' if n == 1 else 's'}"
                           for n, what in ((self.held, "record"), (self.damaged, "damaged span")) if n)
        return (f"the journal is kept as it is, and what the commit log holds of queue {self.queue!r} "
                f"({counts or 'no record'}) is kept for the next start "
                f"(.kestrel/commit-log/held-{self.queue}): restore the journal file from a copy if one "
                "exists and restart, which places it; or restart with --salvage, which serves the "
                "journal as it is and sets the records aside (.kestrel/aside/)")


class JournalNotWritable(CorruptJournalError):
    """Raised at start-up when a file a queue appends to cannot be opened for writing, or a torn
    tail cannot be cut from it (its owner or mode, an immutable or append-only file, a read-only
    mount): the queue is refused alone, as a damaged one is, rather than failing every request with
    nothing in its figures, or the start. Nothing is changed."""

    refusal = "its journal cannot be written"

    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(path, 0, None, f"the server cannot write it: {error.strerror or error}")
        self.args = (f"journal {path} cannot be written: {error.strerror or error}",)

    def remedy(self) -> str:
        return ("give the server's user write access to the file (its owner, its mode, `chattr -i -a`, a "
                "read-write mount) and restart; the file was not changed (--salvage does not apply)")


class JournalFileShared(CorruptJournalError):
    """Raised at start-up for a queue one of whose files is the same file (same device and inode: a
    symbolic or hard link) as a file another queue took: both queues would append to it, each
    replaying the other's records as its own. The later queue is refused alone; nothing is changed."""

    refusal = "its journal file is another queue's"

    def __init__(self, path: str, other: str, owner: str) -> None:
        reason = (f"the same file as {other}, a file of queue {owner!r} (a symbolic or hard link): two "
                  "queues would write one file")
        super().__init__(path, 0, None, reason)
        self.args = (f"journal file {path} is {reason}",)
        self.other = other
        self.owner = owner

    def remedy(self) -> str:
        return (f"remove the link {self.path} (or put a copy of the file in its place, if this queue is "
                f"to keep those items; `ls -li` shows the names sharing a file) and restart; nothing was "
                f"changed (--salvage does not apply)")


class JournalFormatsMixed(CorruptJournalError):
    """Raised at start-up (or as a queue first named after it is created) for a queue whose files are
    in both journal formats: Kestrel 3 writer files beside a file only Kestrel 2 has (the live journal
    `q`, a pack, a `q.<n>` without a writer header): a stray or copied file. Neither format reads the
    other's, and `kestrel journal convert` cannot join them: the queue is refused alone, the files of
    each format named; nothing is changed."""

    refusal = "its files are in both journal formats"

    def __init__(self, kestrel2: list[str], kestrel3: list[str]) -> None:
        reason = (f"Kestrel 2 journal files ({_file_list(kestrel2)}) beside Kestrel 3 writer files "
                  f"({_file_list(kestrel3)}), and a queue's files are in one format")
        super().__init__(kestrel2[0], 0, None, reason)
        self.args = (f"journal file {kestrel2[0]}: {reason}",)

    def remedy(self) -> str:
        return ("keep the files of the format the queue's journal_format names, move the others out of the "
                "queue path and restart; nothing was changed (--salvage does not apply)")


class NotAJournalFile(CorruptJournalError):
    """Raised at start-up (or as a queue first named after it is created) for a queue one of whose
    files is in neither journal format: named as a journal is (`core`, `README`, a junk `q.<n>`) but
    beginning with neither a Kestrel 2 record nor a Kestrel 3 header. No `journal_format` reads it
    and no conversion mends it, so it stops no start: the queue is refused alone, under either
    format, as a damaged one is; nothing is changed."""

    refusal = "a file named as its journal is no journal"

    def __init__(self, path: str, head: bytes) -> None:
        reason = (f"it begins {head.hex(' ')} ({head!r}): neither a Kestrel 2 record (no opcode is "
                  f"{head[0]}) nor a Kestrel 3 header")
        super().__init__(path, 0, None, reason)
        self.args = (f"file {path} is in neither journal format (a stray file named as a journal is): "
                     f"{reason}",)

    def remedy(self) -> str:
        return (f"move {self.path} out of the queue path and restart, the queue loading without it; nothing "
                "was changed (--salvage does not apply)")


def _file_list(paths: list[str], shown: int = 3) -> str:
    names = ", ".join(path.rpartition("/")[2] for path in paths[:shown])
    return names + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


class QueueDamaged(KestrelError):
    """Raised for every request to a queue whose journal was refused (the other queues serve): at
    start-up, or, `later`, as it was first named after it (its files looked at then: a stray file
    put there since). Names the queue, the damage, and how to proceed."""

    def __init__(self, queue: str, error: CorruptJournalError, parent: str | None = None,
                 later: bool = False) -> None:
        whose = f"its parent {parent!r}" if parent else "its journal"
        when = "as it was first named after start-up" if later else "at start-up"
        super().__init__(f"queue {queue!r} is not served: {whose} was refused {when}: {error}; "
                         f"{error.remedy()}")
        self.queue = queue
        self.error = error


class JournalWriteError(KestrelError):
    """Raised when a queue's journal cannot be written (disk full, I/O error).

    The operation did not happen: the journal and the queue are as they were before it. The queue
    stays read-only until its journal can be written again.
    """

    def __init__(self, queue: str, path: str, error: OSError | None) -> None:
        if error is None:
            cause = "it failed earlier and is still not writable"
        elif error.errno == errno.ENOSPC:
            cause = "the disk is full"
        else:
            cause = f"{error.strerror or error}"
        self.failure = f"cannot write the journal of queue {queue!r} ({path}): {cause}"
        super().__init__(f"{self.failure}; the queue is read-only until it can")
        self.queue = queue
        self.path = path
        self.disk_full = error is not None and error.errno in (errno.ENOSPC, errno.EDQUOT)


class JournalReadError(KestrelError):
    """Raised when a queue in read-behind cannot open the journal file its items are read back
    from (out of file descriptors, mostly): that change alone is refused, before anything changed;
    the next change tries again."""

    def __init__(self, queue: str, error: OSError) -> None:
        super().__init__(f"cannot read the items of queue {queue!r} back from its journal "
                         f"({error.filename}): {error.strerror or error}; nothing was changed, try again")
        self.queue = queue


class TooManyQueues(KestrelError):
    """Raised when a new queue is refused: the server holds `max_queues`, or no file descriptor is left."""


class RefusedByStatus(KestrelError):
    """Raised when the server's status (read-only, quiescent) forbids an operation."""


class ErrorQueueRefused(KestrelError):
    """Raised when a poison item's error queue does not take it (full, or the item is too large)."""


class QueuePathInUse(KestrelError):
    """Raised when another process (a server, the journal converter) holds the queue path's lock."""


class ConvertError(KestrelError):
    """Raised when a queue cannot be converted to the other journal format as asked; nothing was changed."""


class MemoryBudgetExceeded(KestrelError):
    """Raised when a put is refused under flow control: what the queues hold in memory stays over
    the server's `max_memory_total` and paging cannot bring it down (src/kestrel/storage/memory.py)."""
