"""The README's Python examples, each run as a user would run it after `pip install`.

Every ```python block of the README is an example, marked by an HTML comment naming it just before
it (`<!-- example: thrift -->`). Each runs in a fresh process of this environment's Python, from a
directory outside the repository and without the repository on PYTHONPATH, so it sees only what the
install gives. An example that talks to a server is written for the default ports on 127.0.0.1; it
runs against a real server started by the fixtures, with only the port numbers replaced.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, ServerProcess

README = ROOT / "README.md"
EXAMPLES = {"thrift", "memcache", "client", "storage", "spark"}
MARKED = re.compile(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)^```$", re.S | re.M)
# The default ports an example may name, and the test server's attribute for each.
PORTS = {2229: "thrift_port", 22133: "memcache_port", 2222: "text_port", 2223: "admin_port"}
DEFAULT_PORT = re.compile(r"(?<![\w.])(" + "|".join(map(str, PORTS)) + r")(?!\w)")

# What each example prints, as its comments say.
OUTPUT = {
    "thrift": ["b'job 1'", "b'job 2'", "QueueInfo(head_item=None, items=0, "],
    "memcache": ["b'message 1'", "b'message 2'", "None"],
    "client": ["b'one job'", "b'a'", "b'b'", "b'c'", "b'd'"],
    "storage": [],
    "spark": ["100", "100"],
}

# Run after the threads example, in its process: the engine ran on plain threads, not on gevent.
STORAGE_EPILOGUE = """
import os

from gevent._hub_local import get_hub_if_exists
from gevent.monkey import is_module_patched

assert get_hub_if_exists() is None, "the threads runtime made a gevent hub"
assert not is_module_patched("threading")
assert sorted(done) == sorted(b"job %d" % n for n in range(100))
assert os.path.exists(os.path.join(spool, "work")), "no journal was written"
"""


def examples() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    found = {name: code for name, code in MARKED.findall(text)}
    assert len(found) == len(MARKED.findall(text)), "two README examples have the same name"
    return found


def with_ports(code: str, server: ServerProcess) -> str:
    """The example with the default ports replaced by the test server's."""
    replaced, count = DEFAULT_PORT.subn(lambda m: str(getattr(server, PORTS[int(m.group(1))])), code)
    assert count, "an example that needs a server names none of the default ports"
    return replaced


def run(code: str, tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 60) -> list[str]:
    """Run `code` as a script from a directory outside the repository, in `env` (default: this
    environment minus PYTHONPATH and PYSPARK_PYTHON, set by the Spark tests of this process); its output."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert ROOT not in elsewhere.resolve().parents
    script = elsewhere / "example.py"
    script.write_text(code)
    environment = env or {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON")}
    done = subprocess.run([sys.executable, str(script)], cwd=elsewhere, env=environment, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"the example failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout.splitlines()


# A line the engine logs (structlog's console lines go to stdout where nothing configured logging).
LOGGED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")


def expect(output: list[str], wanted: list[str]) -> None:
    """The lines printed, logged lines left out, are `wanted` (a line ending in a space: its start)."""
    lines = [line for line in output if not LOGGED.match(line)]
    assert len(lines) == len(wanted), output
    for line, start in zip(lines, wanted, strict=True):
        assert line.startswith(start) if start.endswith(" ") else line == start, (line, start)


def test_every_python_block_is_a_named_example() -> None:
    text = README.read_text(encoding="utf-8")
    assert set(examples()) == EXAMPLES
    assert text.count("```python") == len(EXAMPLES), "a Python block of the README is not marked as an example"
    for name, code in examples().items():
        assert (DEFAULT_PORT.search(code) is not None) == (name != "storage"), name


@pytest.mark.parametrize("name", sorted(EXAMPLES - {"spark"}))
def test_readme_example_runs(name: str, server_factory: Any, tmp_path: Path) -> None:
    code = examples()[name]
    if name == "storage":
        code += STORAGE_EPILOGUE
    else:
        code = with_ports(code, server_factory())
    expect(run(code, tmp_path), OUTPUT[name])


@pytest.mark.slow
@pytest.mark.timeout(900)  # a deadline for a hung Spark, not a budget (see tests/pipeline/test_pipeline.py)
def test_readme_spark_example_runs(server_factory: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyspark", reason="pyspark is installed by `make test` (the spark extra)")
    from tests.support.spark_apps import app_environment
    from tests.support.system import need_java

    need_java()
    code = with_ports(examples()["spark"], server_factory())
    # Only to make it cheaper (the example only sets PYSPARK_PYTHON if unset; this is the same Python).
    expect(run(code, tmp_path, app_environment(tmp_path / "spark"), timeout=600), OUTPUT["spark"])
