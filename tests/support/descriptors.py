"""What a process's descriptors name, read from /proc: the leak checks of the suite."""

from __future__ import annotations

import os


def descriptors(pid: int) -> dict[int, str]:
    """What each of the process's descriptors names (a file's path, `socket:[…]`, `pipe:[…]`)."""
    named = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            named[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor among them)
            pass
    return named


def sockets(pid: int) -> int:
    """How many of the process's descriptors are sockets."""
    return sum(1 for name in descriptors(pid).values() if name.startswith("socket:"))
