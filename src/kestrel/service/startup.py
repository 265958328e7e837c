"""Why a server could not start, in one line, and its exit code.

Every step of a start that touches the world outside the process (the queue path and its lock, the
journals, the status file, each listener's address) runs inside `startup_step(what, where, code)`.
An OSError there, or one of the engine's errors that only the operator can fix, becomes a
StartupError: one line naming the step, the path or address, the reason and what usually causes it,
with the exit code of its class. `kestrel serve` prints it and exits with that code; no traceback.
"""

from __future__ import annotations

import errno
import os
import pwd
import resource
from collections.abc import Iterator
from contextlib import contextmanager

from kestrel.storage.errors import JournalWriteError, QueuePathInUse, TooManyQueues

# `kestrel serve`'s exit codes (its --help and the README's Operations list them).
EXIT_CONFIG = 2  # bad configuration: the config file or the command line
EXIT_DAMAGED_JOURNAL = 3  # damage no one queue owns: an interrupted conversion's record
EXIT_QUEUE_PATH = 4  # the queue path, a journal or the status file cannot be used, or the path is in use
EXIT_LISTENER = 5  # a listener cannot bind its address and port
EXIT_DESCRIPTORS = 6  # out of file descriptors

EXIT_CODES = (
    (0, "stopped cleanly (SIGTERM, SIGINT or the shutdown command)"),
    (EXIT_CONFIG, "bad configuration (config file or command line); every bad key is listed"),
    (EXIT_DAMAGED_JOURNAL, "damage that no one queue owns: the record of an interrupted journal "
                           "conversion (a queue whose own files are damaged is refused alone, and the "
                           "others serve; so is one whose commit log records cannot be placed)"),
    (EXIT_QUEUE_PATH, "the queue path or the status file cannot be used (not a directory, not "
                      "writable, disk full), or another process holds the queue path (a queue whose "
                      "own journal cannot be written is refused alone, and the others serve)"),
    (EXIT_LISTENER, "a listener cannot bind its address:port (in use, a port below 1024 without the "
                    "privilege, an address this machine does not have)"),
    (EXIT_DESCRIPTORS, "out of file descriptors (raise LimitNOFILE or ulimit -n)"),
)

OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


class StartupError(Exception):
    """A start-up step failed for a reason outside the server. `str()` is one line naming what,
    where and why; `exit_code` is its class (EXIT_*)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextmanager
def startup_step(what: str, where: str, exit_code: int) -> Iterator[None]:
    """Run one start-up step on `where` (a path, or address:port); turn its failures into StartupError."""
    try:
        yield
    except OSError as e:
        code = EXIT_DESCRIPTORS if e.errno in OUT_OF_DESCRIPTORS else exit_code
        raise StartupError(describe(e, what, where, listening=exit_code == EXIT_LISTENER), code) from e
    except TooManyQueues as e:  # at start, only for want of descriptors: queues on disk all load
        raise StartupError(str(e), EXIT_DESCRIPTORS) from e
    except QueuePathInUse as e:  # its message names the path and the cause
        raise StartupError(str(e), exit_code) from e
    except JournalWriteError as e:
        raise StartupError(f"{e.failure}; the server cannot start until it can", exit_code) from e


def describe(error: OSError, what: str, where: str, listening: bool = False) -> str:
    """`<what> <where>: [<file>: ]<reason> (<likely cause>)` on one line."""
    name = os.fsdecode(error.filename) if isinstance(error.filename, str | bytes) else None
    file = f"{name}: " if name and name != where else ""
    # EEXIST comes from os.makedirs(exist_ok=True) on something else than a directory.
    reason = "exists and is not a directory" if error.errno == errno.EEXIST else error.strerror or str(error)
    hint = _hint(error.errno, listening)
    return f"{what} {where}: {file}{reason}" + (f" ({hint})" if hint else "")


def _hint(code: int | None, listening: bool) -> str:
    if code in (errno.EACCES, errno.EPERM):
        if listening:
            return "ports below 1024 need root or CAP_NET_BIND_SERVICE"
        return f"the server runs as user {_user()}"
    if code == errno.EADDRINUSE:
        return ("another process holds that port (a listener, or one end of a connection: `ss -tanp` "
                "shows which)")
    if code == errno.EADDRNOTAVAIL:
        return "no network interface of this machine has that address: check listen_address"
    if code == errno.ENOTDIR:
        return "the path or one of its parents is a file"
    if code == errno.ENOENT:
        return "its directory does not exist"
    if code == errno.EMFILE:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return f"the process may open {soft} files: raise LimitNOFILE or ulimit -n"
    if code == errno.ENFILE:
        return "the system's file table is full"
    if listening and code is not None and code < 0:  # getaddrinfo's codes (socket.gaierror)
        return "listen_address must be an address or a name this machine resolves"
    return ""


def _user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
