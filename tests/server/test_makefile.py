"""`make run` installs what serving needs and no more; `make test` what the tests need (README: Quick start).

Checked with `make -n` (what make would run) on a copy of the Makefile, so nothing is installed here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


def planned(tmp_path: Path, target: str, stamps: tuple[str, ...] = ()) -> list[str]:
    """The pip installs `make TARGET` would run in a fresh clone, or in one where `stamps` are up to date."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml", "setup.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    for stamp in stamps:  # made after the files they depend on
        (tmp_path / stamp).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / stamp).touch()
    done = subprocess.run([make, "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "--upgrade pip" not in line]


def test_make_run_installs_the_server_without_test_or_spark_extras(tmp_path: Path) -> None:
    run = installs(planned(tmp_path, "run"))
    assert run and all(line.rstrip().endswith("install --quiet -e .") for line in run), run


def test_make_test_installs_the_test_and_spark_extras(tmp_path: Path) -> None:
    test = installs(planned(tmp_path, "test"))
    assert any("'.[test,spark]'" in line for line in test), test


def test_make_run_after_make_test_installs_nothing_more(tmp_path: Path) -> None:
    # `make test` marks what `make run` needs as installed too, since it installed a superset.
    touched = [line.split()[1:] for line in planned(tmp_path, "test") if line.startswith("touch ")]
    stamps = tuple(stamp for line in touched for stamp in line)
    assert ".venv/.installed-run" in stamps, touched
    assert installs(planned(tmp_path, "run", stamps)) == []


def test_the_compiled_build_is_made_once_per_source_and_again_once_a_source_changed(tmp_path: Path) -> None:
    # `make test` runs the suite on build/compiled: never on compiled code older than its source, and
    # mypyc's minutes of compiling are spent once per source (a touched file is the same source).
    source = tmp_path / "src" / "kestrel" / "turns.py"
    source.parent.mkdir(parents=True)
    source.write_text("TURN = 0.001\n")
    (tmp_path / "README.md").write_text("# Kestrel\n")
    installed = (".venv/.installed-run", ".venv/.installed")

    def wheels(stamps: tuple[str, ...]) -> list[str]:
        return [line for line in planned(tmp_path, "test", stamps) if "pip wheel" in line]

    (build,) = wheels(installed)
    key = build.split(" -w build/wheels/")[1].split()[0]
    built = (*installed, f"build/wheels/{key}/.built", f"build/compiled/.built-{key}")
    assert wheels(built) == []
    edited = time.time() + 60
    os.utime(source, (edited, edited))
    assert wheels(built) == [], "a touched source compiles again"
    source.write_text("TURN = 0.002\n")
    assert wheels(built), "an edited source does not make the compiled build again"


def test_make_test_sets_up_the_machine_before_pytest(tmp_path: Path) -> None:
    lines = planned(tmp_path, "test", (".venv/.installed", ".venv/.installed-run"))
    setup = next(n for n, line in enumerate(lines) if "tests/support/system.py" in line)
    pytest_run = next(n for n, line in enumerate(lines) if "/pytest " in line)
    assert setup < pytest_run, lines


def test_make_clean_keeps_the_queues(tmp_path: Path) -> None:
    """`make run` serves ./var/spool/kestrel: a clean removes what the build made, never data."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    journal = tmp_path / "var" / "spool" / "kestrel" / "jobs"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b"items")
    for made in (".venv", "dist", "build"):
        (tmp_path / made).mkdir()
    done = subprocess.run([make, "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert journal.read_bytes() == b"items"
    assert not any((tmp_path / made).exists() for made in (".venv", "dist", "build"))


def test_make_sanitize_builds_every_helper_under_both_sanitizers_and_runs_the_tests_comparing_them(
        tmp_path: Path) -> None:
    recipe = " ".join(planned(tmp_path, "sanitize", (".venv/.installed", ".venv/.installed-run")))
    helpers, compiled = recipe.split("rm -rf build/sanitize-compiled", 1)  # the helpers' pass, then the compiled build's
    build = helpers[:helpers.index("build_ext")]
    assert "-fsanitize=address,undefined" in build and "-fno-sanitize-recover=all" in build, recipe
    tests = [word for word in helpers[helpers.index("pytest"):].split() if word.startswith("tests/")]
    assert tests and all((ROOT / test).is_file() for test in tests), tests
    # Each helper's comparison with its Python reference is among them.
    for helper, test in [("_binary.c", "test_thrift_binary.py"), ("_scan.c", "test_memcache_runs.py"),
                         ("_item.c", "test_item.py"), ("_crc32c.c", "test_manifest.py"),
                         ("kestrel2/_codec.c", "test_decode_common.py"),
                         ("kestrel3/_codec.c", "test_kestrel3_decode_puts.py"), ("_fsync_many.c", "test_group_commit.py"),
                         ("_receive.c", "test_socket_io.py"), ("_log_record.c", "test_commit_log.py"),
                         ("_disk.c", "test_disk_write.py"), ("_clock.c", "test_clock.py")]:
        assert list((ROOT / "src").rglob(helper)) and any(t.endswith(test) for t in tests), helper
    assert len(list((ROOT / "src").rglob("*.c"))) == 11  # a new helper needs its line above
    # The compiled build's pass: heap checks, with Python's allocator off, over the engine's tests.
    assert "-fsanitize=address" in compiled and "asan-stack=0" in compiled, recipe
    run = compiled[compiled.index("pytest"):].split()
    assert "PYTHONMALLOC=malloc" in compiled and "KESTREL_TEST_BUILD=compiled" in compiled, recipe
    assert "tests/storage" in run and "tests/session" in run, run
