"""The storage package's names load on first use, and each exported name has a home."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kestrel import storage


def test_every_exported_name_loads_from_its_home() -> None:
    assert sorted(storage._HOMES) == sorted(storage.__all__)
    for name in storage.__all__:
        assert getattr(storage, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        storage.Nothing  # noqa: B018


def test_importing_one_module_leaves_the_engine_unloaded() -> None:
    code = "import sys, kestrel.storage.errors; print('kestrel.storage.collection' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
