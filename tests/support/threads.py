"""The threads of a process, from /proc."""

from __future__ import annotations

import os


def thread_files(pid: int | str, name: str) -> dict[int, str]:
    """The text of each thread's `/proc/<pid>/task/<tid>/<name>` (`stat`, `comm`, `children`), by
    thread id; a thread that ends between the listing and its read is left out."""
    texts = {}
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/{name}") as f:
                texts[int(thread)] = f.read()
        except OSError:  # ended meanwhile
            continue
    return texts
