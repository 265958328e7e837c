"""Data source options the Spark way: camelCase names, snake_case aliases, unknown names refused.

Spark hands a Python data source its options lower-cased, so names match case-insensitively, and
an unknown name is reported as Spark passed it (lower-cased) with the documented spelling of the
option it most likely meant.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str  # camelCase, as documented
    parse: Callable[[str, str], Any]  # (name, text) -> value; raises ValueError naming the option
    default: Any = None
    doc: str = ""

    @property
    def alias(self) -> str:
        """The snake_case spelling accepted as well (`maxItems` → `max_items`)."""
        return re.sub(r"(?<!^)([A-Z])", r"_\1", self.name).lower()


def whole(minimum: int = 0) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            number = int(str(text).strip())
        except ValueError:
            raise ValueError(f"option {name!r} must be a whole number, got {text!r}") from None
        if number < minimum:
            raise ValueError(f"option {name!r} must be at least {minimum}, got {number}")
        return number
    return parse


def text(name: str, value: str) -> str:
    if not str(value).strip():
        raise ValueError(f"option {name!r} cannot be empty")
    return str(value).strip()


def queue_name(name: str, value: str) -> str:
    """One queue's name, as the server would take it; a comma is refused (Spark lists things with
    commas, and a name such as 'a,b' would create a queue of that name on the server)."""
    from kestrel.storage.errors import InvalidQueueName
    from kestrel.storage.filenames import check_queue_name

    queue = text(name, value)
    if "," in queue:
        raise ValueError(f"option {name!r}: {queue!r} is not one queue's name (a comma); give one queue")
    try:
        check_queue_name(queue)
    except InvalidQueueName as e:
        raise ValueError(f"option {name!r}: {e}") from None
    return queue


def queue_names(name: str, value: str) -> list[str]:
    """One queue or several, comma-separated (as Kafka's `subscribe` lists topics), each checked as
    `queue_name` checks one; an empty entry or a queue listed twice is refused. An entry may be a
    pattern (`jobs-*`: see src/kestrel/pipeline/subscription.py), checked as a name is."""
    names: list[str] = []
    for position, part in enumerate(text(name, value).split(","), 1):
        queue = part.strip()
        if not queue:
            raise ValueError(f"option {name!r} has an empty entry at position {position} in {value!r} "
                             f"(a stray comma?)")
        names.append(queue_name(name, queue))
        if names.count(queue) > 1:
            raise ValueError(f"option {name!r} lists {queue!r} twice")
    return names


def reader_name(name: str, value: str) -> str:
    """A fanout child's name after the `+` (`<queue>+<reader>`), checked as the server would."""
    reader = text(name, value)
    if "+" in reader:
        raise ValueError(f"option {name!r}: {reader!r} contains '+': give the reader's own name, the "
                         f"part after the '+' of queue+reader")
    from kestrel.storage.errors import InvalidQueueName
    from kestrel.storage.filenames import check_queue_name

    try:
        check_queue_name(f"queue+{reader}")
    except InvalidQueueName as e:
        raise ValueError(f"option {name!r}: {reader!r} cannot name a fanout child ({e})") from None
    return reader


def choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, value: str) -> str:
        for a in allowed:
            if str(value).strip().lower() == a.lower():
                return a
        raise ValueError(f"option {name!r} must be one of {', '.join(allowed)}; got {value!r}")
    return parse


def meant(key: str, spec: list[Option]) -> str | None:
    """The documented name of the option `key` most likely misspells, if one is close enough."""
    by_key = {spelling.lower(): option.name for option in spec for spelling in (option.name, option.alias)}
    close = difflib.get_close_matches(key.lower(), list(by_key), n=1, cutoff=0.75)
    return by_key[close[0]] if close else None


def unknown_option(what: str, key: str, spec: list[Option]) -> str:
    """The message for an option no operation of `spec` takes: the likely meant name, then every one."""
    guess = meant(key, spec)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    valid = ", ".join(sorted(o.name for o in spec))
    return f"{what}: unknown option {key!r}{hint}; valid options are: {valid}"


def parse_options(given: Mapping[str, str], spec: list[Option], what: str,
                  required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Values by camelCase name; refuses unknown names (listing the valid ones) and missing ones."""
    by_key: dict[str, Option] = {}
    for option in spec:
        by_key[option.name.lower()] = option
        by_key[option.alias.lower()] = option
    values: dict[str, Any] = {option.name: option.default for option in spec}
    seen: dict[str, str] = {}
    for key, raw in given.items():
        found = by_key.get(key.lower())
        if found is None:
            raise ValueError(unknown_option(what, key, spec))
        option = found
        if option.name in seen:
            raise ValueError(f"{what}: option {option.name!r} given twice "
                             f"({seen[option.name]!r} and {key!r})")
        seen[option.name] = key
        values[option.name] = option.parse(option.name, raw)
    for name in required:
        if values.get(name) is None:
            raise ValueError(f"{what}: option {name!r} is required")
    return values
