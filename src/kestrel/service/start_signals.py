"""The signals `kestrel serve` takes before its event loop handles them.

From the command's first line (src/kestrel/service/cli.py) until the server's own handlers replace
these (`App.run`, `App.start`): a SIGHUP is noted, and the reload it asks for runs once the queues
are loaded, where the default action ended the process (an init script sending it just after a
start killed the server, exit 129, nothing logged); a SIGTERM or SIGINT ends the process at once,
as a stop while the queues load always did (nothing has been served, and a start ended at any point
loses nothing: docs/durability.md), but with a line saying so and exit 0, a clean stop.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

_reload_asked = False


def install() -> None:
    signal.signal(signal.SIGHUP, _note_reload)
    signal.signal(signal.SIGTERM, _stop_now)
    signal.signal(signal.SIGINT, _stop_now)


def reload_asked() -> bool:
    """Whether a SIGHUP came before the server's handler of it."""
    return _reload_asked


def _note_reload(signum: int, frame: FrameType | None) -> None:
    global _reload_asked
    _reload_asked = True


def _stop_now(signum: int, frame: FrameType | None) -> None:
    # os.write: the handler may interrupt a write to the same stream half done.
    os.write(2, f"kestrel: {signal.Signals(signum).name} while starting: stopped at once (nothing was "
                f"served yet, and a start stopped at any point loses nothing)\n".encode())
    os._exit(0)
