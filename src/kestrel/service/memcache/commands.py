"""Kestrel's memcache dialect: command lines parsed into values, with no I/O.

`parse_line` turns one request line (without its line ending) into a Command or raises
ProtocolError carrying the reply to send (`CLIENT_ERROR <reason>`, as Kestrel answers an unknown
or malformed command) and, for a refused `set`, what to do with the item data that follows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from kestrel.service.cross_protocol import http_refusal, speaks_http
from kestrel.service.numerals import decimal, is_digits
from kestrel.storage.clock import Clock

# Absolute expiry times are at or above this; smaller ones are relative seconds (memcache's rule).
RELATIVE_EXPIRY_LIMIT = 1_000_000


class ProtocolError(Exception):
    """A request that gets an error reply; `reply` is the line to send, without CRLF.

    After a refused `set`, `skip` is how many bytes of item data follow the line and must be
    dropped unread; `close` says the connection must close (the item's length is unknown).
    """

    def __init__(self, reply: str, skip: int = 0, close: bool = False) -> None:
        super().__init__(reply)
        self.reply = reply
        self.skip = skip
        self.close = close


def client_error(reason: str) -> ProtocolError:
    """The client's error, its reason at most 512 characters (a bad value of a 64 KB line is not
    echoed whole), as the text protocol's."""
    return ProtocolError(f"CLIENT_ERROR {reason if len(reason) <= 512 else reason[:509] + '...'}")


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
    keys: tuple[str, ...] = ()  # dump_stats' queue names
    get: GetOptions | None = None
    cas: bool = False  # `gets`: VALUE lines carry a CAS field
    expiry: int = 0
    size: int = 0
    noreply: bool = False
    count: int | None = None  # confirm's count, monitor's max items
    timeout_ms: int = 0  # monitor's period
    status: str | None = None  # the new status of `status <new>`


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
            value = decimal(option[2:], 10)
            if value is None:
                raise client_error(f"bad timeout {option!r}: expected t=<milliseconds>")
            timeout = value
        elif name not in ("open", "close", "abort", "peek"):
            raise client_error(f"unknown get option {option!r}")
    if "peek" in seen and seen & {"open", "close", "abort"}:
        raise client_error("peek cannot be combined with open, close or abort")
    if "abort" in seen and seen & {"open", "close"}:
        raise client_error("abort cannot be combined with open or close")
    return GetOptions(queue, timeout, "open" in seen, "close" in seen, "abort" in seen, "peek" in seen)


def _int(text: str, what: str, low: int = 0, high: int = 2**63 - 1) -> int:
    value = decimal(text, 20, signed=True)  # (2**64 has 20 digits: the range says what is over)
    if value is None:
        raise client_error(f"bad {what} {text!r}")
    if not low <= value <= high:
        raise client_error(f"{what} {value} out of range {low}..{high}")
    return value


def _seconds_ms(text: str) -> int:
    """`monitor`'s period: whole or decimal seconds, finite and not negative → milliseconds. Its
    whole seconds are a number as any other (Kestrel's are `toInt`), its fraction digits alone."""
    whole, _, fraction = text.partition(".")
    plain = (whole + fraction) != "" and (fraction == "" or is_digits(fraction))
    seconds = decimal(whole or "0", 10) if plain else None
    if seconds is None:
        raise client_error(f"bad monitor period {text!r}: expected seconds, a number 0 or more")
    return seconds * 1000 + int((fraction + "000")[:3])


def _split_noreply(args: list[str]) -> tuple[list[str], bool]:
    if args and args[-1] == "noreply":
        return args[:-1], True
    return args, False


# memcache exptime is a 32-bit field: relative seconds, or epoch seconds up to 2106.
EXPIRY_LOW, EXPIRY_HIGH = -(2**31), 2**32 - 1
MAX_ITEM_BYTES = 2**31 - 1
# memcache storage commands Kestrel does not support: their data block is read and dropped, never
# run as commands, as Kestrel's decoder reads the data of any storage command.
_UNSUPPORTED_STORAGE = ("add", "replace", "append", "prepend", "cas")
# The arguments of each storage command before `noreply`: `<key> <flags> <exptime> <bytes>`, and
# `cas`'s `<cas unique>` after them.
_STORAGE_ARGUMENTS = dict.fromkeys(("set", *_UNSUPPORTED_STORAGE), 4) | {"cas": 5}


def _data_length(name: str, args: list[str]) -> int | None:
    """A storage command's `<bytes>` field (its fourth argument), or None when it cannot be read:
    on a line with more or fewer arguments than the command takes, which one is the count is
    unknown (`set my queue 0 0 5` would skip 2 bytes of the 5 and read the rest as commands)."""
    count = _STORAGE_ARGUMENTS[name]
    if not (len(args) == count or (len(args) == count + 1 and args[-1] == "noreply")):
        return None
    size = decimal(args[3], 10)
    return size if size is not None and size <= MAX_ITEM_BYTES else None


def _refusal(name: str, args: list[str], reply: str) -> ProtocolError:
    """The error a refused command gets: after a storage command's line its announced data block
    is skipped unread, or, where its length cannot be read, the connection closes (the data would
    be read as commands)."""
    if name not in _STORAGE_ARGUMENTS:
        return ProtocolError(reply)
    size = _data_length(name, args)
    if size is None:
        return ProtocolError(reply + " (closing: the item's length is unknown)", close=True)
    return ProtocolError(reply, skip=size + 2)


def _parse_set(name: str, args: list[str]) -> Command:
    """`set <queue> <flags> <exptime> <bytes> [noreply]`; a refusal says how much data to skip."""
    size = _data_length("set", args)
    try:
        if len(args) not in (4, 5) or (len(args) == 5 and args[4] != "noreply"):
            raise client_error("usage: set <queue> <flags> <exptime> <bytes> [noreply]")
        if size is None:
            raise client_error(f"bad byte count {args[3]!r}: expected 0..{MAX_ITEM_BYTES}")
        _int(args[1], "flags", 0, 2**32 - 1)  # checked, not kept: items carry no flags (replies say 0)
        return Command("set", key=args[0], expiry=_int(args[2], "exptime", EXPIRY_LOW, EXPIRY_HIGH),
                       size=size, noreply=len(args) == 5)
    except ProtocolError as e:
        raise _refusal("set", args, e.reply) from None


def _parse_get(name: str, args: list[str]) -> Command:
    if not args:
        raise client_error(f"usage: {name} <queue>[/options]")
    # Kestrel serves the first key of a multi-key get and ignores the rest.
    return Command("get", key=args[0], get=parse_get_key(args[0]), cas=name == "gets")


def _parse_unsupported(name: str, args: list[str]) -> Command:
    raise _refusal(name, args, f"CLIENT_ERROR {name} is not supported: kestrel queues take set")


def _parse_one_queue(name: str, args: list[str]) -> Command:
    """`delete`, `flush`, `flush_expired <queue> [noreply]`: a lone `noreply` is the queue's name."""
    args, noreply = _split_noreply(args) if len(args) > 1 else (args, False)
    if len(args) == 2 and name == "delete" and args[1] == "0":
        args = args[:1]  # memcache's old delete time argument
    if len(args) != 1:
        raise client_error(f"usage: {name} <queue> [noreply]")
    return Command(name, key=args[0], noreply=noreply)


def _parse_flush_all(name: str, args: list[str]) -> Command:
    args, noreply = _split_noreply(args)
    if len(args) > 1:
        raise client_error("usage: flush_all [delay] [noreply]")
    if args:
        _int(args[0], "flush_all delay")
    return Command(name, noreply=noreply)


def _parse_dump_stats(name: str, args: list[str]) -> Command:
    return Command(name, keys=tuple(args))  # every word a queue's name: no reply to leave out


def _parse_args_ignored(name: str, args: list[str]) -> Command:
    """Commands whose arguments Kestrel ignores, as memcached does for `version` and `stats <group>`
    (libmemcached's memcdump sends `stats cachedump 0 0`)."""
    return Command(name, noreply=_split_noreply(args)[1])


def _parse_monitor(name: str, args: list[str]) -> Command:
    args = _split_noreply(args)[0]
    if len(args) not in (2, 3):
        raise client_error("usage: monitor <queue> <seconds> [max-items]")
    count = _int(args[2], "max-items") if len(args) == 3 else None
    return Command(name, key=args[0], timeout_ms=_seconds_ms(args[1]), count=count)


def _parse_confirm(name: str, args: list[str]) -> Command:
    args, noreply = _split_noreply(args)
    if len(args) != 2:
        raise client_error("usage: confirm <queue> <count>")
    return Command(name, key=args[0], count=_int(args[1], "count"), noreply=noreply)


def _parse_status(name: str, args: list[str]) -> Command:
    args, noreply = _split_noreply(args)
    if len(args) > 1:
        raise client_error("usage: status [up|readonly|quiescent]")
    return Command(name, status=args[0] if args else None, noreply=noreply)


# Every command read, by name: a line naming another closes the connection (`_parse`).
_COMMANDS: dict[str, Callable[[str, list[str]], Command]] = {
    "get": _parse_get, "gets": _parse_get, "set": _parse_set,
    **dict.fromkeys(_UNSUPPORTED_STORAGE, _parse_unsupported),
    **dict.fromkeys(("delete", "flush", "flush_expired"), _parse_one_queue),
    "flush_all": _parse_flush_all, "dump_stats": _parse_dump_stats,
    **dict.fromkeys(("version", "shutdown", "reload", "stats", "dump_config", "quit", "flush_all_expired"),
                    _parse_args_ignored),
    "monitor": _parse_monitor, "confirm": _parse_confirm, "status": _parse_status,
}

# The longest line whose Command is remembered: a client's lines are its own to choose, and 4,096
# distinct lines of 64 KB (`dump_stats` with thousands of names) would hold gigabytes for good.
CACHED_LINE_BYTES = 256


def parse_line(line: bytes) -> Command:
    """Parse one command line. Raises ProtocolError with the reply for bad input.

    Clients repeat the same few lines (`get work`, `set work 0 0 128`), and a Command is frozen, so
    each distinct short line is parsed once and its Command shared; refusals are not remembered.
    """
    return _parse_remembered(line) if len(line) <= CACHED_LINE_BYTES else _parse(line)


def _parse(line: bytes) -> Command:
    try:
        text = line.decode("utf-8")
        valid = True
    except UnicodeDecodeError:  # refused, but split as it is: a storage command's data is skipped
        text = line.decode("utf-8", "replace")
        valid = False
    parts = [part for part in text.split(" ") if part]  # spaces only, as memcached: a key holds no space
    if not parts:
        raise client_error("empty command line")
    if speaks_http(parts):
        raise ProtocolError(f"CLIENT_ERROR {http_refusal('memcache')}", close=True)
    name = parts[0].lower()
    parse = _COMMANDS.get(name)
    if parse is None:
        # What follows may be its data (memcached's meta `ms`, a storage command misspelt), which
        # would run as commands: closed, as Kestrel closes after any unknown command.
        raise ProtocolError(f"CLIENT_ERROR unknown command {name[:64]!r} (closing: its data, if any, "
                            "cannot be told from commands)", close=True)
    if not valid:
        raise _refusal(name, parts[1:], "CLIENT_ERROR command line is not valid UTF-8")
    return parse(name, parts[1:])


_parse_remembered = functools.lru_cache(maxsize=4096)(_parse)


def absolute_expiry_ms(exptime: int, clock: Clock) -> int:
    """memcache exptime → absolute ms: 0 never; under 1,000,000 relative seconds; else epoch seconds.
    The clock is read only for a relative time (most sets never expire)."""
    if exptime == 0:
        return 0
    if exptime < 0:
        return clock.now_ms()  # already expired, as memcache treats negative times
    if exptime < RELATIVE_EXPIRY_LIMIT:
        return clock.now_ms() + exptime * 1000
    return exptime * 1000
