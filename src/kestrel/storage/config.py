"""Queue settings (the guide's QueueBuilder fields) and Kestrel 2.3.4 inheritance.

A setting reaches a queue through four layers, each overriding the one before:
built-in defaults → `default_queue` → an explicitly configured master queue → its fanout child.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Final

from kestrel.storage.errors import ConfigError, InvalidQueueName
from kestrel.storage.filenames import check_queue_name

KB = 1024
MB = 1024 * KB
GB = 1024 * MB
UNLIMITED = 2**63 - 1
# The largest int the compiled build keeps unboxed (mypyc's short int): a total compared with a
# larger limit, UNLIMITED among them, is compared as two Python objects. No count or size of a
# queue reaches it, so it stands in for any larger limit (`native_limit`).
NATIVE_LIMIT: Final = (1 << 62) - 1


# The longest duration a setting takes: an item's expiry, its add time plus `max_age`, must still fit
# the journals' signed 64-bit milliseconds (about 146 million years; past it every put would fail).
MAX_DURATION_MS: Final = (1 << 62) - 1


def native_limit(limit: int) -> int:
    """`limit` as a put compares totals with it: itself, or NATIVE_LIMIT when larger, which no
    total reaches either (the setting itself, which the config and stats show, stays as it is)."""
    return min(limit, NATIVE_LIMIT)


_SIZE_UNITS = {
    "": 1, "b": 1, "k": KB, "kb": KB, "m": MB, "mb": MB, "g": GB, "gb": GB, "t": 1024 * GB, "tb": 1024 * GB,
}
_DURATION_UNITS = {
    "ms": 1, "msec": 1, "millisecond": 1, "milliseconds": 1,
    "s": 1000, "sec": 1000, "second": 1000, "seconds": 1000,
    "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000,
    "h": 3_600_000, "hour": 3_600_000, "hours": 3_600_000,
    "d": 86_400_000, "day": 86_400_000, "days": 86_400_000,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def _amount(text: str, units: Mapping[str, int]) -> int | None:
    """`16MB`, `1.5s`: the number, exactly (no float rounds or overflows it), times its unit in
    `units`, rounded down; None where `text` is not such a number."""
    m = _QUANTITY.match(text)
    if m is None or m.group(2).lower() not in units:
        return None
    try:
        return int(Fraction(m.group(1)) * units[m.group(2).lower()])
    except ValueError:  # more digits than Python reads into an int
        return None


def _at_most(key: str, value: int, most: int, unit: str, given: Any) -> int:
    """`value`, or ConfigError when it is over `most`: every count, size and duration fits what
    holds it (a signed 64-bit integer at most, as in Kestrel's settings), so that none is refused
    only later, by a put or the listener."""
    if value > most:
        raise ConfigError(key, f"at most {most}{unit}, got {given!r}")
    return value


def parse_size(key: str, value: Any, most: int = UNLIMITED,
               expected: str = "a size such as 16MB, 512KB or a byte count") -> int:
    """Bytes from an int or a string such as `16MB`, `512k`, `1GB`; at most `most`. What is not a
    size is refused as not `expected`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(key, f"a size cannot be negative, got {value!r}")
        return _at_most(key, value, most, " bytes", value)
    if isinstance(value, str):
        size = _amount(value, _SIZE_UNITS)
        if size is not None:
            return _at_most(key, size, most, " bytes", value)
    raise ConfigError(key, f"expected {expected}, got {value!r}")


def parse_duration_ms(key: str, value: Any, most: int = MAX_DURATION_MS) -> int:
    """Milliseconds from a string such as `500ms`, `1s`, `10 minutes`; 0 stays 0; at most `most`."""
    if value == 0 and not isinstance(value, bool):
        return 0
    if isinstance(value, str):
        ms = _amount(value, _DURATION_UNITS)
        if ms is not None:
            return _at_most(key, ms, most, " ms", value)
    raise ConfigError(key, f"expected a duration with a unit such as 500ms, 1s or 10min, got {value!r}")


def parse_optional_duration_ms(key: str, value: Any, most: int = MAX_DURATION_MS) -> int | None:
    """A duration where null, 0 or `never` mean "no limit"."""
    if value is None or value == "never":
        return None
    ms = parse_duration_ms(key, value, most)
    return ms or None


def parse_sync(key: str, value: Any) -> int | None:
    """`always` → 0, `never` → None, a duration → that many milliseconds between fsyncs."""
    if value == "always" or value is True:
        return 0
    if value == "never" or value is False or value is None:
        return None
    try:
        return parse_duration_ms(key, value)
    except ConfigError:
        raise ConfigError(key, f"expected always, never or a duration between fsyncs such as 10ms, "
                               f"got {value!r}") from None


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(key, f"expected true or false, got {value!r}")


def parse_count(key: str, value: Any, most: int = UNLIMITED) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return _at_most(key, value, most, "", value)
    raise ConfigError(key, f"expected a non-negative whole number, got {value!r}")


JOURNAL_FORMATS = ("kestrel2", "kestrel3")


def parse_journal_format(key: str, value: Any) -> str:
    if value in JOURNAL_FORMATS:
        return str(value)
    raise ConfigError(key, f"expected one of {', '.join(JOURNAL_FORMATS)}, got {value!r}")


def parse_queue_ref(key: str, value: Any) -> str | None:
    """A queue name a setting points at, checked as a request's would be (None: none)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a queue name, got {value!r}")
    try:
        check_queue_name(value)
    except InvalidQueueName as e:
        raise ConfigError(key, str(e)) from None
    return value


@dataclass(frozen=True)
class QueueConfig:
    """One queue's settings, with the guide's defaults. Sizes in bytes, times in milliseconds."""

    max_items: int = UNLIMITED
    max_size: int = UNLIMITED
    max_item_size: int = UNLIMITED
    max_age: int | None = None
    default_journal_size: int = 16 * MB
    max_memory_size: int = 128 * MB
    max_journal_size: int = 1 * GB
    discard_old_when_full: bool = False
    keep_journal: bool = True
    sync_journal: int | None = None  # 0 = fsync before every ack, N = every N ms, None = never
    expire_to_queue: str | None = None
    max_expire_sweep: int = UNLIMITED
    fanout_only: bool = False
    max_queue_age: int | None = None
    journal_format: str = "kestrel2"  # which on-disk journal this queue keeps (JOURNAL_FORMATS)
    max_errors: int = 0  # 0 = off; an item aborted this many times leaves the queue as poison
    error_queue: str | None = None  # where poison items go; None drops them

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any], key: str = "queue",
                     base: QueueConfig | None = None) -> QueueConfig:
        """Settings from a YAML mapping laid over `base` (with none, `base` itself: the queues of
        no settings of their own share the default's one object, which every put and get reads,
        rather than each reading a copy of its own); unknown keys are errors naming `key`."""
        if not isinstance(settings, Mapping):
            raise ConfigError(key, f"expected a mapping of queue settings, got {settings!r}")
        changes: dict[str, Any] = {}
        for name, value in settings.items():
            parser = _PARSERS.get(name)
            if parser is None:
                known = ", ".join(sorted(_PARSERS))
                raise ConfigError(f"{key}.{name}", f"unknown queue setting (known: {known})")
            changes[name] = parser(f"{key}.{name}", value)
        if base is None:
            return cls(**changes)
        return dataclasses.replace(base, **changes) if changes else base

    def values(self) -> dict[str, Any]:
        """Each setting by name, as the server holds it (sizes in bytes, times in ms, None for none)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> dict[str, Any]:
        """The settings as plain values, for `dump_config` and logs, as the config file writes them:
        `sync_journal` as always, never or a duration; no value as null."""
        out = self.values()
        sync = out["sync_journal"]
        out["sync_journal"] = "never" if sync is None else "always" if sync == 0 else f"{sync}ms"
        return {name: "null" if value is None else value for name, value in out.items()}


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "max_items": parse_count,
    "max_size": parse_size,
    "max_item_size": parse_size,
    "max_age": parse_optional_duration_ms,
    "default_journal_size": parse_size,
    "max_memory_size": parse_size,
    "max_journal_size": parse_size,
    "discard_old_when_full": parse_bool,
    "keep_journal": parse_bool,
    "sync_journal": parse_sync,
    "expire_to_queue": parse_queue_ref,
    "max_expire_sweep": parse_count,
    "fanout_only": parse_bool,
    "max_queue_age": parse_optional_duration_ms,
    "journal_format": parse_journal_format,
    "max_errors": parse_count,
    "error_queue": parse_queue_ref,
}


class QueueConfigs:
    """Resolves each queue name to its settings with 2.3.4 inheritance.

    `default` is the `default_queue` mapping; `queues` maps names to their explicit mappings.
    Everything is parsed up front so that a bad file fails at start, not on first use.
    """

    def __init__(self, default: Mapping[str, Any] | None = None,
                 queues: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.default = QueueConfig.from_mapping(default or {}, "default_queue")
        self._raw = dict(queues or {})
        self._resolved: dict[str, QueueConfig] = {}
        for name in self._raw:
            self._resolved[name] = self._resolve(name)

    def _resolve(self, name: str) -> QueueConfig:
        master, plus, _child = name.partition("+")
        base = self.default
        if plus and master in self._raw:
            base = QueueConfig.from_mapping(self._raw[master], f"queues.{master}", base)
        return QueueConfig.from_mapping(self._raw.get(name, {}), f"queues.{name}", base)

    def configured_names(self) -> list[str]:
        """The queues named under `queues`."""
        return list(self._raw)

    def for_queue(self, name: str) -> QueueConfig:
        """The settings of queue `name`. A name not configured has its parent's (a fanout child's) or
        the default's, that one object, and nothing is kept for it: a server whose clients named a
        million queues, each made and deleted, held an entry for every name."""
        cfg = self._resolved.get(name)
        if cfg is not None:
            return cfg
        master, plus, _child = name.partition("+")
        return self._resolved.get(master, self.default) if plus else self.default


# The settings naming the queue that items leave to: what leaves, the setting that turns the move off
# at 0 (None: always on), and whether the queue itself may be named (an `expire_to_queue` naming its
# own queue drops its expired items, as Kestrel's did; an error queue of its own would keep poison).
QUEUE_TARGETS = (("error_queue", "poison items", "max_errors", False),
                 ("expire_to_queue", "expired items", None, True))


def check_across_queues(configs: QueueConfigs, aliases: Mapping[str, list[str]]) -> None:
    """The checks of settings that concern more than one queue, at a start and at a reload
    (`check_queue_targets`, `check_fanout_formats`). Raises ConfigError naming the setting."""
    check_queue_targets(configs, aliases)
    check_fanout_formats(configs)


def check_fanout_formats(configs: QueueConfigs) -> None:
    """Refuse a fanout child configured in another `journal_format` than its parent's: a child is
    kept in its parent's journal (a Kestrel 3 parent's reader, or a Kestrel 2 journal of its own
    beside the parent's), so its setting would go unheeded, and the next start would refuse the
    files made meanwhile as in the other format. Raises ConfigError naming the child's setting."""
    for name in sorted(configs.configured_names()):
        parent, plus, _ = name.partition("+")
        if not plus:
            continue
        child, kept = configs.for_queue(name).journal_format, configs.for_queue(parent).journal_format
        if child != kept:
            raise ConfigError(f"queues.{name}.journal_format",
                              f"{child}, but a fanout child is kept in its parent's journal format, and "
                              f"queue {parent!r} is {kept}: set journal_format on {parent!r} (converting "
                              f"its files with `kestrel journal convert`), not on its child")


def check_queue_targets(configs: QueueConfigs, aliases: Mapping[str, list[str]]) -> None:
    """Refuse an `error_queue` or `expire_to_queue` that is an alias, or an `error_queue` that is the
    queue itself: the items would go to a queue made under the alias's name, which no read reaches,
    or go round for good.

    Checked for every configured queue and for each target (which inherits `default_queue`'s
    settings too). Raises ConfigError naming the setting.
    """
    configured = set(configs.configured_names())
    for setting, leaving, switch, itself in QUEUE_TARGETS:
        targets = [getattr(configs.for_queue(q), setting) for q in configured]
        names = configured | {t for t in [getattr(configs.default, setting), *targets] if t}
        for name in sorted(names):
            config = configs.for_queue(name)
            target = getattr(config, setting)
            if target is None or (switch is not None and not getattr(config, switch)):
                continue
            key = f"queues.{name}.{setting}" if name in configured else f"default_queue.{setting}"
            try:
                check_queue_name(target)
            except InvalidQueueName as e:
                raise ConfigError(key, str(e)) from None
            if target in aliases:
                raise ConfigError(key, f"{target!r} is an alias; {leaving} need a queue")
            if target == name and not itself:
                raise ConfigError(key, f"queue {name!r} cannot be its own error queue (set "
                                       f"queues.{name}.max_errors: 0 or another error_queue)")


_UNITS: dict[Callable[[str, Any], Any], str] = {
    parse_size: "bytes", parse_optional_duration_ms: "ms", parse_sync: "sync", parse_count: "count",
    parse_bool: "flag",
}


def setting_unit(name: str) -> str:
    """How a queue setting's value reads: "bytes", "ms" (None: no limit), "sync" (0: always, None:
    never, else ms between fsyncs), "count", "flag" or "text"; UNLIMITED is no limit."""
    parser = _PARSERS.get(name)
    return _UNITS.get(parser, "text") if parser is not None else "text"
