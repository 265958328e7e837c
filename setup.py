"""The build's compiled parts; everything else is declared in pyproject.toml.

- The request path (`COMPILED_MODULES` in src/kestrel/build.py) compiled by mypyc from its typed
  Python source into extension modules, the source staying beside them in the package. Built for a
  wheel or a plain install, not for an editable one (`pip install -e`, `make test`'s): there the
  Python source must be what runs, or an extension module built earlier would shadow every later
  edit. Skipped too where mypyc is missing, with `KESTREL_PURE_PYTHON=1`, or where it fails to
  build (no C compiler): the Python modules then serve alone, as they do in an editable install.
- The C helpers (`C_HELPERS`), `optional=True`: where no C compiler is at hand the build goes on
  without them, and the Python code each one stands in for serves alone: the group commit uses
  Python threads (src/kestrel/storage/fsync/group_commit.py), items are
  `kestrel.storage.item.QItemPython`, CRC32C is `kestrel.storage.crc32c.crc32c_python`, a commit log
  record is encoded by `kestrel.storage.commit_log.append_record_python`, the journal
  readers use `kestrel.storage.kestrel2.codec.decode_common_python` and
  `kestrel.storage.kestrel3.codec.decode_puts_python`, the Thrift binary protocol its
  Python readers and writers (src/kestrel/service/thrift/protocol.py), and the memcache port parses
  each command alone (src/kestrel/service/memcache/runs.py). `make sanitize` builds them under
  AddressSanitizer and UBSan and runs their tests.

It also puts `src/kestrel-pyspark-python.pth` at the top of the built package, beside the modules,
so that an install places it in site-packages, where Python reads it at start-up (see
src/kestrel_pyspark_python.py); setuptools declares no such file in pyproject.toml.
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import BaseError, CCompilerError, CompileError

BUILD = runpy.run_path("src/kestrel/build.py")  # the lists, without importing the package
# The compiled request path's shared library is `kestrel__mypyc` beside the package (mypyc derives
# the compiled modules' `__file__` from its place, so it must stay above the package); each compiled
# module's own extension only calls into it.
GROUP = "kestrel"
PTH = "kestrel-pyspark-python.pth"


def _path(module: str, suffix: str) -> str:
    return f"src/{module.replace('.', '/')}{suffix}"


class BuildExt(build_ext):
    """build_ext with the request path compiled by mypyc, where wanted and possible. A compiled build
    is all or nothing: a module that fails to build drops them all."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.mypyc: list[Extension] = []
        self.mypyc_failed = False

    def finalize_options(self) -> None:
        if self._compiles_request_path():
            self.mypyc = _mypyc_extensions()
            self.distribution.ext_modules = [*(self.distribution.ext_modules or []), *self.mypyc]
        super().finalize_options()

    def _compiles_request_path(self) -> bool:
        """Whether this build compiles the request path: a wheel's or an install's, not an
        editable install's (whose command is `editable_wheel`) nor one that builds in place, nor
        the metadata or an sdist, and not with `KESTREL_PURE_PYTHON=1`."""
        if os.environ.get("KESTREL_PURE_PYTHON", "") not in ("", "0") or self.inplace:
            return False
        return bool({"bdist_wheel", "build", "build_ext", "install"} & set(self.distribution.commands))

    def build_extension(self, ext: Any) -> None:
        if ext in self.mypyc and self.mypyc_failed:
            return
        try:
            if ext in self.mypyc:
                with _compiling_in_parallel(self.compiler):
                    super().build_extension(ext)
            else:
                super().build_extension(ext)
        except (CCompilerError, CompileError, BaseError):
            if ext not in self.mypyc:
                raise
            print(f"warning: compiling {ext.name} failed: the request path stays pure Python")
            self.mypyc_failed = True

    def run(self) -> None:
        super().run()
        if self.mypyc_failed:
            self.extensions = [ext for ext in self.extensions if ext not in self.mypyc]
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Remove the extension modules in the package that this build did not make: those of an
        earlier build (a module no longer compiled, a compiled build before a pure one, or one
        left half built). Beside their Python source, they would run instead of it."""
        made = {Path(self.get_ext_fullpath(ext.name)).resolve() for ext in self.extensions}
        root = Path("src" if self.inplace else self.build_lib)
        for found in [*root.glob(f"{GROUP}__mypyc.*"), *(root / "kestrel").rglob("*.so")]:
            if found.resolve() not in made:
                print(f"removing {found}: not made by this build")
                found.unlink()


class BuildWithPth(build_py):
    """build_py that also places the start-up hook's .pth beside the package."""

    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


@contextmanager
def _compiling_in_parallel(compiler: Any) -> Iterator[None]:
    """The C files of one extension compiled a process per core (setuptools compiles them one after
    another): the request path's group is a C file per module, most of the build's time."""
    compile_all = compiler.compile

    def compile_each(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # each thread waits on its compiler
            objects = pool.map(lambda source: compile_all([source], *args, **kwargs), sources)
            return [obj for each in objects for obj in each]

    compiler.compile = compile_each
    try:
        yield
    finally:
        compiler.compile = compile_all


# mypy's checks that depend on the third-party packages' own types, which a build environment may
# lack (pip's isolated build has only the build's requirements): their classes and results are then
# Any, which compiles the same, but strict mode would refuse. `make lint` runs them with the types.
WITHOUT_THIRD_PARTY_TYPES = ["--allow-subclassing-any", "--no-warn-unused-ignores", "--no-warn-return-any"]


def _mypyc_extensions() -> list[Extension]:
    """The request path's extension modules (C generated by mypyc under build/), or none."""
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("warning: mypyc is not installed: the request path stays pure Python")
        return []
    paths = [_path(module, ".py") for module in BUILD["COMPILED_MODULES"]]
    try:
        extensions: list[Extension] = mypycify(
            [*paths, *WITHOUT_THIRD_PARTY_TYPES, "--cache-dir", "build/mypy-cache"], group_name=GROUP,
            multi_file=True, debug_level="0")  # a C file per module; no debug information (symbols stay)
    except SystemExit:  # mypy's errors are printed above
        print("warning: mypyc refused the request path: it stays pure Python")
        return []
    return extensions


# What the C helpers' system calls share (a descriptor from a Python int, the retry after EINTR):
# one header, included by each.
SHARED_HEADER = "src/kestrel/system_calls.h"


def _c_helper(name: str) -> Extension:
    """A C helper's extension module, built from its C file, or left out where it cannot be."""
    return Extension(name, [_path(name, ".c")], optional=True, libraries=BUILD["C_LIBRARIES"].get(name, []),
                     include_dirs=[os.path.dirname(SHARED_HEADER)], depends=[SHARED_HEADER])


setup(
    cmdclass={"build_ext": BuildExt, "build_py": BuildWithPth},
    ext_modules=[_c_helper(name) for name in BUILD["C_HELPERS"]],
)
