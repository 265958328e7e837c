"""Kestrel's memcache dialect: command lines parsed into values, with no I/O.

`parse_line` turns one request line (without its line ending) into a Command or raises
ProtocolError carrying the reply to send (`ERROR` for an unknown command, `CLIENT_ERROR <reason>`
for a malformed one).
"""

from __future__ import annotations

from dataclasses import dataclass

# Absolute expiry times are at or above this; smaller ones are relative seconds (memcache's rule).
RELATIVE_EXPIRY_LIMIT = 1_000_000


class ProtocolError(Exception):
    """A request that gets an error reply; `reply` is the line to send, without CRLF."""

    def __init__(self, reply: str) -> None:
        super().__init__(reply)
        self.reply = reply


def client_error(reason: str) -> ProtocolError:
    return ProtocolError(f"CLIENT_ERROR {reason}")


@dataclass(frozen=True, slots=True)
class GetOptions:
    """The options after a queue name in GET: `/t=<ms>`, `/open`, `/close`, `/abort`, `/peek`."""

    queue: str
    timeout_ms: int = 0
    open: bool = False
    close: bool = False
    abort: bool = False
    peek: bool = False


@dataclass(frozen=True, slots=True)
class Command:
    """One parsed request. `key` is exactly what the client sent (echoed in VALUE lines)."""

    name: str
    key: str = ""
    args: tuple[str, ...] = ()
    get: GetOptions | None = None
    flags: int = 0
    expiry: int = 0
    size: int = 0
    noreply: bool = False


def parse_get_key(key: str) -> GetOptions:
    """`work/t=500/open` → GetOptions; illegal combinations are refused with the reason."""
    queue, *options = key.split("/")
    if not queue:
        raise client_error("missing queue name")
    timeout = 0
    seen: set[str] = set()
    for option in options:
        name = "t" if option.startswith("t=") else option
        if name in seen:
            raise client_error(f"option {option!r} given twice")
        seen.add(name)
        if name == "t":
            value = option[2:]
            if not value.isdigit() or len(value) > 10:
                raise client_error(f"bad timeout {option!r}: expected t=<milliseconds>")
            timeout = int(value)
        elif name not in ("open", "close", "abort", "peek"):
            raise client_error(f"unknown get option {option!r}")
    if "peek" in seen and seen & {"open", "close", "abort"}:
        raise client_error("peek cannot be combined with open, close or abort")
    if "abort" in seen and seen & {"open", "close"}:
        raise client_error("abort cannot be combined with open or close")
    return GetOptions(queue, timeout, "open" in seen, "close" in seen, "abort" in seen, "peek" in seen)


def _int(text: str, what: str, low: int = 0, high: int = 2**63 - 1) -> int:
    if not text.lstrip("-").isdigit() or len(text) > 20:
        raise client_error(f"bad {what} {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise client_error(f"{what} {value} out of range")
    return value


_NO_ARGS = {"version", "flush_all", "shutdown", "reload", "stats", "dump_stats", "dump_config", "quit"}
_ONE_KEY = {"delete", "flush"}


def parse_line(line: bytes) -> Command:
    """Parse one command line. Raises ProtocolError with the reply for bad input."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise client_error("command line is not valid UTF-8") from None
    parts = text.split()
    if not parts:
        raise ProtocolError("ERROR")
    name = parts[0].lower()
    args = parts[1:]
    if name in ("get", "gets"):
        if len(args) != 1:
            raise client_error("get takes exactly one queue name")
        return Command("get", key=args[0], get=parse_get_key(args[0]))
    if name == "set":
        if len(args) not in (4, 5) or (len(args) == 5 and args[4] != "noreply"):
            raise client_error("usage: set <queue> <flags> <exptime> <bytes> [noreply]")
        return Command("set", key=args[0], flags=_int(args[1], "flags", 0, 2**32 - 1),
                       expiry=_int(args[2], "exptime", -(2**31), 2**63 - 1),
                       size=_int(args[3], "byte count", 0, 2**31 - 1), noreply=len(args) == 5)
    if name in _ONE_KEY:
        noreply = bool(args) and args[-1] == "noreply"
        rest = args[:-1] if noreply else args
        if len(rest) == 2 and name == "delete" and rest[1] == "0":
            rest = rest[:1]  # memcache's old delete time argument
        if len(rest) != 1:
            raise client_error(f"usage: {name} <queue> [noreply]")
        return Command(name, key=rest[0], noreply=noreply)
    if name in _NO_ARGS:
        if args and name not in ("flush_all",):
            raise client_error(f"{name} takes no arguments")
        return Command(name)
    if name == "monitor":
        if len(args) not in (2, 3):
            raise client_error("usage: monitor <queue> <seconds> [max-items]")
        return Command(name, key=args[0], args=tuple(args[1:]))
    if name == "confirm":
        if len(args) != 2:
            raise client_error("usage: confirm <queue> <count>")
        return Command(name, key=args[0], args=(str(_int(args[1], "count")),))
    if name == "status":
        if len(args) > 1:
            raise client_error("usage: status [up|readonly|quiescent]")
        return Command(name, args=tuple(args))
    raise ProtocolError("ERROR")


def absolute_expiry_ms(exptime: int, now_ms: int) -> int:
    """memcache exptime → absolute ms: 0 never; under 1,000,000 relative seconds; else epoch seconds."""
    if exptime == 0:
        return 0
    if exptime < 0:
        return now_ms  # already expired, as memcache treats negative times
    if exptime < RELATIVE_EXPIRY_LIMIT:
        return now_ms + exptime * 1000
    return exptime * 1000
