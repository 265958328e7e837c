"""Kestrel's text protocol: request lines parsed into values, with no I/O.

`parse_line` turns one request line (without its line ending) into a TextCommand, or raises
TextError carrying the error to send (a blank line too: Kestrel answers every line). A line ending
with `:` or starting with the word `put` always opens an item block (items one per line, up to an
empty line), even when it is refused, so that item lines are never taken for commands. As in
Kestrel's TextHandler, a command reads the words it takes by position and ignores any after them,
and its numbers may be negative. Error texts are Kestrel's where Kestrel has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kestrel.service.cross_protocol import http_refusal, speaks_http
from kestrel.service.numerals import decimal


class TextError(Exception):
    """A request that gets `-<message>`; `opens_block` marks a refused put whose items follow,
    `close` a line after which the connection must close (`cross_protocol`)."""

    def __init__(self, message: str, opens_block: bool = False, close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.opens_block = opens_block
        self.close = close


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
PUT_USAGE = "usage: put <queue> [expiry-ms]: then one item per line, then an empty line"


@dataclass(frozen=True, slots=True)
class _Arguments:
    """What a command reads from the words after its name, by position, as Kestrel's TextHandler
    does: the first word (a queue, or `status`'s new status), then numbers. Fewer than `required`
    words is the `missing` error; words past the last one read are ignored, as in Kestrel."""

    required: int = 0
    missing: str = QUEUE_REQUIRED
    first: str | None = "queue"  # the field the first word fills
    numbers: tuple[tuple[str, str], ...] = ()  # (field, error) for the second word on


_TIMEOUT = ("timeout_ms", "Error parsing timeout.")
_ARGUMENTS: Final[dict[str, _Arguments]] = {
    "put": _Arguments(1, numbers=(("expiry_ms", "Error parsing expiration time."),)),
    "get": _Arguments(1, numbers=(_TIMEOUT,)),
    "peek": _Arguments(1, numbers=(_TIMEOUT,)),
    # max-items is this server's (memcache's MONITOR has it); Kestrel's text monitor reads no third word
    "monitor": _Arguments(2, "Queue name & timeout required.",
                          numbers=(_TIMEOUT, ("count", "Error parsing max items."))),
    "confirm": _Arguments(2, "Queue name & count required.", numbers=(("count", "Error parsing count."),)),
    "flush": _Arguments(1),
    "delete": _Arguments(1),
    "status": _Arguments(first="status"),
    "version": _Arguments(first=None),
    "quit": _Arguments(first=None),
    "shutdown": _Arguments(first=None),
}


def _number(text: str, error: str, opens_block: bool) -> int:
    """A decimal integer, negative allowed as by Kestrel's `toInt`; at most 18 significant digits."""
    value = decimal(text, 18, signed=True)
    if value is None:
        raise TextError(error, opens_block)
    return value


def _command(name: str, args: list[str], opens_block: bool) -> TextCommand:
    """The command `name` with the words after it, read by its `_Arguments`."""
    grammar = _ARGUMENTS.get(name)
    if grammar is None:
        raise TextError(f"Unknown command: {name[:64]}", opens_block)
    if len(args) < grammar.required:
        raise TextError(grammar.missing, opens_block)
    fields: dict[str, Any] = {}
    if grammar.first is not None and args:
        fields[grammar.first] = args[0]
    for (field, error), word in zip(grammar.numbers, args[1:], strict=False):  # the shorter ends it
        fields[field] = _number(word, error, opens_block)
    return TextCommand(name, **fields)


def parse_line(line: bytes) -> TextCommand:
    """Parse one command line. Raises TextError for bad input, and for a blank line Kestrel's
    answer to the command it reads there, the empty one (`-Unknown command: `).

    As in Kestrel, a line ending with `:` is followed by an item block; so is any line starting
    with the word `put` (a put that forgot its colon still has its items skipped, not run).
    """
    stripped = line.rstrip()
    block = stripped.endswith(b":")
    # At runs of ASCII whitespace, where Kestrel splits at each space: its `get q  5` reads an
    # empty timeout and fails, ours reads `get q 5`.
    raw = (stripped[:-1] if block else stripped).split()
    if not raw:
        if block:
            raise TextError(PUT_USAGE, opens_block=True)
        raise TextError("Unknown command: ")
    is_put = raw[0].lower() == b"put"
    try:
        words = [word.decode("utf-8") for word in raw]
    except UnicodeDecodeError:
        raise TextError("command line is not valid UTF-8", opens_block=block or is_put) from None
    if speaks_http(words):
        raise TextError(http_refusal("text"), close=True)
    name, args = words[0].lower(), words[1:]
    if is_put != block:
        raise TextError(PUT_USAGE, opens_block=True)
    return _command(name, args, opens_block=block)
