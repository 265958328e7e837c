"""A value made for every item or request in compiled code is made natively: mypyc leaves a
dataclass's generated `__init__` interpreted, and a frozen one's took about 4 µs a value
(docs/architecture.md, "The compiled build"). Its fields stay read-only all the same."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

from kestrel.build import build_name
from kestrel.service.text.commands import TextCommand
from kestrel.storage.kestrel3 import codec as k3

PER_ITEM: list[tuple[type, tuple[Any, ...]]] = [
    (k3.Put, (7, 0, 1_700_000_000_000, None, b"item")),
    (k3.ReadHead, (7,)),
    (k3.ReadDone, ((8, 9),)),
    (TextCommand, ("get", "jobs")),
]


@pytest.mark.parametrize("cls, args", PER_ITEM, ids=[cls.__name__ for cls, _ in PER_ITEM])
def test_a_value_made_per_item_has_a_compiled_init_and_read_only_fields(cls: type, args: tuple[Any, ...]) -> None:
    if build_name() != "compiled":
        pytest.skip("the pure build runs every __init__ interpreted: the compiled build is the one asked about")
    assert not isinstance(cls.__init__, types.FunctionType), f"{cls.__name__}.__init__ runs interpreted"
    value = cls(*args)
    assert value == cls(*args) and repr(value).startswith(f"{cls.__name__}(")
    for field in dataclasses.fields(cls):
        with pytest.raises(AttributeError):
            setattr(value, field.name, getattr(value, field.name))
