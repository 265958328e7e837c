"""The two builds of one source: which one a process runs, and that an editable install never runs
compiled code older than its source.

The compiled build (a wheel's, `make test`'s build/compiled) has the modules of
`kestrel.build.COMPILED_MODULES` as extension modules, compiled by mypyc, each beside its Python
source; the pure build (an editable install, `KESTREL_PURE_PYTHON=1`, no compiler) runs that source.
`KESTREL_TEST_BUILD` (set by `make test`) names the build the suite must be running, so a compiled
build that silently came out pure fails here rather than passing as the pure one. The pure build
serving without the C helpers either: tests/server/test_without_compiler.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kestrel.build import C_HELPERS, COMPILED_MODULES, build_name
from tests.conftest import ROOT, ServerProcess


def test_this_process_runs_one_whole_build_the_one_asked_for() -> None:
    name = build_name()
    assert name in ("compiled", "pure")
    assert name == os.environ.get("KESTREL_TEST_BUILD", name)
    for module_name in COMPILED_MODULES:
        module = importlib.import_module(module_name)
        assert module.__file__ is not None
        compiled = isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader)
        assert compiled == (name == "compiled"), module.__file__
        source = Path(module.__file__).with_name(module_name.rsplit(".", 1)[1] + ".py")
        assert source.is_file(), f"{module_name}: no Python source beside {module.__file__}"


def test_a_server_runs_the_build_of_the_tests(server: ServerProcess) -> None:
    assert server.started_build() == build_name()


@pytest.mark.slow
def test_an_editable_install_runs_its_source_and_removes_compiled_modules_left_beside_it(tmp_path: Path) -> None:
    # What `pip install -e` runs (setuptools' build_editable hook), in a copy of the repository
    # holding a compiled module of the request path left over from some earlier build: it must not
    # compile the request path in place, and the stale module must go, or it would run instead of
    # its source whatever edits follow.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "var", "*.egg-info", "__pycache__", "tests", "bench", "*.so"))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    stale = [source / "src" / "kestrel" / "service" / f"turns{suffix}", source / "src" / f"kestrel__mypyc{suffix}"]
    for path in stale:
        path.write_bytes(b"compiled from an older source")
    hook = "from setuptools import build_meta; build_meta.build_editable('wheels')"
    done = subprocess.run([sys.executable, "-c", hook], cwd=source, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [path for path in stale if path.exists()]
    in_place = {path.name.split(".")[0] for path in (source / "src").rglob(f"*{suffix}")}
    assert in_place <= {name.rsplit(".", 1)[1] for name in C_HELPERS}, in_place  # the C helpers only
    generated = list((source / "build").rglob("*.c")) if (source / "build").exists() else []
    assert not generated, f"mypyc generated C for an editable install: {generated}"


def test_the_compiled_modules_give_each_caught_exception_name_one_type() -> None:
    # mypyc gives a local name one type for its whole function, where Python lets each `except ...
    # as e` bind its own: after `except ProtocolError as e`, `except Exception as e` raised TypeError
    # in the compiled memcache handler instead of answering SERVER_ERROR.
    for module in COMPILED_MODULES:
        path = ROOT / "src" / f"{module.replace('.', '/')}.py"
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            caught: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    caught.setdefault(node.name, set()).add(ast.unparse(node.type))
            mixed = {name: types for name, types in caught.items() if len(types) > 1}
            assert not mixed, f"{path}:{function.lineno} {function.name}: {mixed}"


@pytest.mark.skipif(build_name() != "compiled", reason="the pure build interprets every module")
def test_a_compiled_request_path_runs_no_interpreted_code_of_the_package(server_state: Any) -> None:
    """A Thrift put and get and a memcache set and get, each answered as its connection answers it,
    call no function of the package's Python source: what the build leaves interpreted (the runtime,
    the item's Python twin) stays off the path of a request."""
    from kestrel.service.memcache.handler import MemcacheConnection
    from kestrel.service.thrift.handler import ThriftConnection
    from tests.support.thrift_wire import encode_call

    ours, theirs = socket.socketpair()  # where a reply sent between requests goes
    thrift = ThriftConnection(server_state, ours, "test")
    memcache = MemcacheConnection(server_state, ours, "test")
    put = encode_call("binary", "put", queue_name="q", items=[b"x" * 128], expiration_msec=0)
    get = encode_call("binary", "get", queue_name="q", max_items=1, timeout_msec=0, auto_abort_msec=0)
    burst = b"set m 0 0 3\r\nabc\r\nget m\r\n"

    def requests() -> None:
        assert thrift.answer_frame(put) is not None and thrift.answer_frame(get) is not None
        assert memcache.process(bytearray(burst)) == len(burst)

    requests()  # the first requests make the queues and look up what later ones keep
    package = str(Path(importlib.import_module("kestrel").__file__ or "").parent)
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        requests()
    finally:
        sys.setprofile(None)
    assert called == []
    memcache.send()
    assert theirs.recv(4096).endswith(b"abc\r\nEND\r\n")
    ours.close()
    theirs.close()
