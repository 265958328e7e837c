"""The repository's shape: one package at one path, nothing generic importable, no dead references.

Every file of `kestrel.*` lives at the path its import name says (`src/kestrel/storage/queue.py` is
`kestrel.storage.queue`), so mypy, an editor and a static reading of the imports all resolve them;
links would give each file several paths and hide the imports from such tools.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from tests.conftest import ROOT

TEXT_FILES = re.compile(r"\.(py|pyi|c|h|md|yaml|toml|cfg|txt|sh|service|conf)$|(^|/)Makefile$")
# A path of this repository named in prose or a comment: it starts at one of the repository's folders
# (or one of the package's, read from the naming file's own folder) and names a file.
NAMED_PATH = re.compile(
    r"(?<![/\w.~-])((?:src|service|storage|client|pipeline|contract|kestrel|kestrel2|kestrel3|fsync|tools|session"
    r"|thrift|memcache|text|bench|tests|deploy|docs|\.ci)/[\w./-]*\w\.(?:py|pyi|c|h|md|yaml|thrift|conf|service|sh"
    r"|toml))\b")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line.split("\t", 1)[1] for line in out.stdout.splitlines()]


def prose(path: Path) -> str:
    """What a reader reads as prose: a Python file's comments and docstrings, any other file whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return text
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT]
    tree = ast.parse(text)
    docs = [ast.get_docstring(node) or "" for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return "\n".join(comments + docs)


def test_no_file_is_a_link() -> None:
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in out.stdout.splitlines() if line.startswith("120000")]
    assert links == []
    assert not [p for p in (ROOT / "src").rglob("*") if p.is_symlink()]


def test_every_path_named_in_a_comment_or_doc_exists() -> None:
    dead = []
    for name in tracked_files():
        if not TEXT_FILES.search(name) or name.startswith("tests/_generated"):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for named in sorted(set(NAMED_PATH.findall(prose(path)))):
            if not ((ROOT / named).exists() or (path.parent / named).exists()):
                dead.append(f"{name} names {named}")
    assert dead == []


def test_only_the_package_and_the_spark_modules_are_importable(tmp_path: Path) -> None:
    # As a user's Python sees the editable install: from any folder, without PYTHONPATH.
    probe = ("import importlib.util as u, json\n"
             "names = ['storage', 'service', 'client', 'pipeline', 'contract', 'tests', 'bench', 'setup',\n"
             "         'kestrel', 'pyspark_kestrel', 'pyspark_kestrel_journal']\n"
             "print(json.dumps({n: (s.origin if (s := u.find_spec(n)) else None) for n in names}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    import json

    found = json.loads(out.stdout)
    src = (ROOT / "src").resolve()
    assert {n for n, origin in found.items() if origin is None} == {
        "storage", "service", "client", "pipeline", "contract", "tests", "bench", "setup"}
    for name in ("kestrel", "pyspark_kestrel", "pyspark_kestrel_journal"):
        assert Path(found[name]).resolve().is_relative_to(src), found[name]


def test_each_module_is_loaded_under_one_name() -> None:
    # Importing the whole package (the build the tests run) leaves no file behind two module objects.
    probe = ("import pkgutil, sys, kestrel\n"
             "for m in pkgutil.walk_packages(kestrel.__path__, 'kestrel.'):\n"
             "    if '.examples' not in m.name and not m.name.endswith('__main__'):\n"
             "        __import__(m.name)\n"
             "files = [getattr(m, '__file__', None) for m in list(sys.modules.values())]\n"
             "package = kestrel.__path__[0] + '/'\n"
             "mine = [f for f in files if f and f.startswith(package)]\n"
             "print(len(mine), len(set(mine)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    count, distinct = map(int, out.stdout.split())
    assert count == distinct and count > 50


def test_every_benchmark_command_the_docs_give_runs() -> None:
    """A command the README or bench/README.md gives for a benchmark starts (its --help), run as written
    from the repository root; run by its file path, a script would not find the `bench` package."""
    commands = set()
    for doc in ("README.md", "bench/README.md"):
        text = (ROOT / doc).read_text()
        assert not re.search(r"`(?:python3? )?bench/\w+\.py --", text), f"{doc} runs a benchmark by its path"
        commands |= set(re.findall(r"python -m (bench\.\w+)", text))
    assert "bench.bench_aims" in commands  # the README's own (its figures come from it)
    for module in sorted(commands):
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, (module, done.stderr[-2000:])


_PURE_BUILD_MARK = re.compile(r"(?:^@|marks=)pytest\.mark\.pure_build\b", re.M)


def test_every_module_with_pure_build_tests_runs_in_make_test_s_pure_pass() -> None:
    """A test marked `pure_build` is skipped on the compiled build, so `make test` runs it only if its
    module is in the Makefile's PURE_TESTS (a file, or a folder holding it)."""
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^PURE_TESTS :=((?:.*\\\n)*.*)$", makefile, re.M)
    assert listed is not None, "the Makefile has no PURE_TESTS"
    paths = listed.group(1).replace("\\\n", " ").split()
    marked = [path for path in tracked_files()
              if path.startswith("tests/") and path.endswith(".py") and path != "tests/conftest.py"
              and _PURE_BUILD_MARK.search((ROOT / path).read_text())]
    assert marked, "no test is marked pure_build: this check looks for the wrong mark"
    left_out = [path for path in marked
                if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)]
    assert left_out == [], f"modules with pure_build tests outside PURE_TESTS: {left_out}"
