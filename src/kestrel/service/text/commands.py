"""Kestrel's text protocol: request lines parsed into values, with no I/O.

`parse_line` turns one request line (without its line ending) into a TextCommand, or raises
TextError carrying the error to send (a blank line too: Kestrel answers every line). A line ending
with `:` or starting with the word `put` always opens an item block (items one per line, up to an
empty line), even when it is refused, so that item lines are never taken for commands. Error texts
are Kestrel's where Kestrel has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


class TextError(Exception):
    """A request that gets `-<message>`; `opens_block` marks a refused put whose items follow."""

    def __init__(self, message: str, opens_block: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.opens_block = opens_block


@dataclass(init=False, slots=True)
class TextCommand:
    """One parsed request (made for each: its own `__init__`, docs/architecture.md)."""

    name: Final[str]
    queue: Final[str]
    timeout_ms: Final[int]  # get/peek: how long to wait; monitor: how long to watch
    expiry_ms: Final[int | None]  # put: relative expiry of every item of the block
    count: Final[int | None]  # confirm: how many; monitor: at most how many items
    status: Final[str | None]  # status: the new status

    def __init__(self, name: str, queue: str = "", timeout_ms: int = 0, expiry_ms: int | None = None,
                 count: int | None = None, status: str | None = None) -> None:
        self.name = name
        self.queue = queue
        self.timeout_ms = timeout_ms
        self.expiry_ms = expiry_ms
        self.count = count
        self.status = status


QUEUE_REQUIRED = "Queue name required."
_WAIT_COMMANDS = {"get", "peek"}
_ONE_QUEUE = {"flush", "delete"}
_NO_ARGS = {"version", "quit", "shutdown"}


def _number(text: str, error: str, signed: bool = False, opens_block: bool = False) -> int:
    digits = text[1:] if signed and text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise TextError(error, opens_block)
    return int(text)


PUT_USAGE = "usage: put <queue> [expiry-ms]: then one item per line, then an empty line"


def _parse_put(args: list[str]) -> TextCommand:
    """The words after `put` in `put <queue> [expiry-ms]:`."""
    if not args:
        raise TextError(QUEUE_REQUIRED, opens_block=True)
    if len(args) > 2:
        raise TextError("Error parsing expiration time.", opens_block=True)
    expiry = None
    if len(args) == 2:
        expiry = _number(args[1], "Error parsing expiration time.", signed=True, opens_block=True)
    return TextCommand("put", queue=args[0], expiry_ms=expiry)


def parse_line(line: bytes) -> TextCommand:
    """Parse one command line. Raises TextError for bad input, and for a blank line Kestrel's
    answer to the command it reads there, the empty one (`-Unknown command: `).

    As in Kestrel, a line ending with `:` is followed by an item block; so is any line starting
    with the word `put` (a put that forgot its colon still has its items skipped, not run).
    """
    stripped = line.rstrip()
    block = stripped.endswith(b":")
    raw = (stripped[:-1] if block else stripped).split()  # ASCII whitespace only, as Kestrel
    if not raw:
        if block:
            raise TextError(PUT_USAGE, opens_block=True)
        raise TextError("Unknown command: ")
    is_put = raw[0].lower() == b"put"
    try:
        words = [word.decode("utf-8") for word in raw]
    except UnicodeDecodeError:
        raise TextError("command line is not valid UTF-8", opens_block=block or is_put) from None
    name, args = words[0].lower(), words[1:]
    if is_put or block:
        if not (is_put and block):
            raise TextError(PUT_USAGE, opens_block=True)
        return _parse_put(args)
    if name in _WAIT_COMMANDS:
        if not args:
            raise TextError(QUEUE_REQUIRED)
        if len(args) > 2:
            raise TextError(f"usage: {name} <queue> [timeout-ms]")
        timeout = _number(args[1], "Error parsing timeout.") if len(args) == 2 else 0
        return TextCommand(name, queue=args[0], timeout_ms=timeout)
    if name == "monitor":
        if len(args) < 2:
            raise TextError("Queue name & timeout required.")
        if len(args) > 3:
            raise TextError("usage: monitor <queue> <timeout-ms> [max-items]")
        count = _number(args[2], "Error parsing max items.") if len(args) == 3 else None
        return TextCommand(name, queue=args[0], timeout_ms=_number(args[1], "Error parsing timeout."),
                           count=count)
    if name == "confirm":
        if len(args) != 2:
            raise TextError("Queue name & count required.")
        return TextCommand(name, queue=args[0], count=_number(args[1], "Error parsing count."))
    if name in _ONE_QUEUE:
        if len(args) != 1:
            raise TextError(QUEUE_REQUIRED if not args else f"usage: {name} <queue>")
        return TextCommand(name, queue=args[0])
    if name == "status":
        if len(args) > 1:
            raise TextError("usage: status [up|readonly|quiescent]")
        return TextCommand(name, status=args[0] if args else None)
    if name in _NO_ARGS:
        if args:
            raise TextError(f"{name} takes no arguments")
        return TextCommand(name)
    raise TextError(f"Unknown command: {name[:64]}")
