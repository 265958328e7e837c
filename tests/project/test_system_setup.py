"""The suite's machine set-up (tests/support/system.py): where it cannot install, it says so and
changes nothing; the tests then skip, naming what is missing."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import system


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"ran {args[0]} where it should only have explained")


def test_without_root_it_names_what_it_cannot_install(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(system, "PACKAGES", {"no-such-package": "no-such-command-here"})
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(subprocess, "run", refuse)
    system.install_packages()
    assert capsys.readouterr().err.strip() == (
        "test set-up: cannot install no-such-package (not root); the tests that need them will skip")


def test_without_apt_get_it_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                    tmp_path: Path) -> None:
    monkeypatch.setattr(system, "PACKAGES", {"no-such-package": "no-such-command-here"})
    monkeypatch.setattr(system, "EXTRACTED", {"a-tool": ("no-such-package", "usr/bin/a-tool")})
    monkeypatch.setattr(system, "CACHE", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, no dpkg-deb
    monkeypatch.setattr(subprocess, "run", refuse)
    system.install_packages()
    system.extract_files()
    err = capsys.readouterr().err
    assert "cannot install no-such-package (no apt-get (not Debian))" in err
    assert "cannot extract a-tool from no-such-package (not Debian)" in err


def test_a_missing_tool_skips_the_test_naming_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.skip.Exception, match=r"thrift is missing \(Debian's thrift-compiler package\): "
                                                   r"`make test` sets it up as root"):
        system.tool("thrift")
