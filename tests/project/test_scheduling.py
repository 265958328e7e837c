"""The suite's own scheduling under pytest-xdist (tests/support/scheduling.py): shared fixtures keep their
tests in one process, groups are dealt out evenly, durations are remembered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.support.scheduling import DURATIONS_KEY, deal_out, plain_nodeid


class FakeItem:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid = nodeid
        self.slow = slow

    def get_closest_marker(self, name: str) -> Any:
        return name if name == "slow" and self.slow else None


def test_group_suffix_is_taken_off_but_not_an_at_sign_in_a_parameter() -> None:
    assert plain_nodeid("t.py::test_x@t.py") == "t.py::test_x"
    assert plain_nodeid("t.py::test_x[a@b]") == "t.py::test_x[a@b]"
    assert plain_nodeid("t.py::test_x[a@b]@spark-1") == "t.py::test_x[a@b]"


def test_dealing_out_balances_known_durations_and_keeps_the_file_order() -> None:
    items = [FakeItem(f"t.py::t{i}") for i in range(6)]
    durations = {"t.py::t0": 20.0, "t.py::t1": 9.0, "t.py::t2": 8.0, "t.py::t3": 2.0, "t.py::t4": 1.0}
    groups = deal_out(items, 2, durations)  # type: ignore[arg-type]
    totals = sorted(sum(durations.get(i.nodeid, 0.5) for i in g) for g in groups)
    assert totals == [20.0, 20.5]
    for group in groups:
        assert [i.nodeid for i in group] == sorted(i.nodeid for i in group)
    assert sorted(i.nodeid for g in groups for i in g) == [i.nodeid for i in items]


def test_dealing_out_unknown_tests_goes_round_the_hands_slow_ones_first() -> None:
    items = [FakeItem("t.py::a"), FakeItem("t.py::b", slow=True), FakeItem("t.py::c"), FakeItem("t.py::d")]
    groups = deal_out(items, 3, {})  # type: ignore[arg-type]
    assert sorted(len(g) for g in groups) == [1, 1, 2]
    assert ["t.py::b"] in [[i.nodeid for i in g] for g in groups]  # the slow one alone
    assert deal_out(items[:1], 3, {}) == [items[:1]]  # type: ignore[arg-type]  # no empty groups


SCRATCH = "tests"  # the scratch project's test folder, whose files this module writes
PROJECT = {
    "tests/__init__.py": "",
    "tests/support/__init__.py": "",
    "tests/conftest.py": (
        "def pytest_configure(config):\n"
        "    from tests.support.scheduling import Scheduler\n"
        "    config.pluginmanager.register(Scheduler(config), 'kestrel-scheduling')\n"),
    f"{SCRATCH}/test_shared.py": (
        "import os, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def resource():\n"
        "    return 'expensive'\n"
        + "".join(f"def test_s{i}(resource):\n    open('ran/s{i}', 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n"
                  for i in range(6))),
    f"{SCRATCH}/test_alone.py": "".join(
        f"def test_a{i}():\n    open('ran/a{i}', 'w').write(__import__('os').environ['PYTEST_XDIST_WORKER'])\n"
        for i in range(6)),
}


@pytest.mark.slow
def test_a_module_fixture_keeps_its_tests_in_one_process_and_durations_are_kept(tmp_path: Path) -> None:
    for name, text in PROJECT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "tests" / "support" / "scheduling.py").write_text(
        (ROOT / "tests" / "support" / "scheduling.py").read_text())
    (tmp_path / "ran").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # xdist alone starts faster
    command = [sys.executable, "-m", "pytest", "-p", "xdist", "-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
               "--rootdir", str(tmp_path), "tests"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    shared = {(tmp_path / "ran" / f"s{i}").read_text() for i in range(6)}
    assert len(shared) == 1, shared
    kept = json.loads((tmp_path / ".pytest_cache" / "v" / DURATIONS_KEY).read_text())
    assert set(kept) == {f"{SCRATCH}/test_shared.py::test_s{i}" for i in range(6)} | {
        f"{SCRATCH}/test_alone.py::test_a{i}" for i in range(6)}
