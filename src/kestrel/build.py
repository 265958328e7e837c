"""What the build compiles, and which build this process runs.

The package has one source, its typed Python. Where the build has mypyc and a C compiler
(setup.py), the request path's modules, `COMPILED_MODULES`, are compiled from that source into
extension modules, and the byte-level codecs of `C_HELPERS` are built from their C beside the
Python code they stand in for. Elsewhere (`KESTREL_PURE_PYTHON=1`, an editable install, no
compiler) the Python modules serve alone, with the same behaviour: the pure build.

setup.py reads the two lists from this file without importing the package, so this module imports
nothing of it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

# Compiled by mypyc from their Python source: the protocols' connection loops and codecs.
COMPILED_MODULES = (
    "kestrel.service.socket_io",
    "kestrel.service.turns",
    "kestrel.service.buffered_connection",
    "kestrel.service.thrift.protocol",
    "kestrel.service.thrift.messages",
    "kestrel.service.thrift.transport",
    "kestrel.service.thrift.handler",
    "kestrel.service.memcache.commands",
    "kestrel.service.memcache.runs",
    "kestrel.service.memcache.handler",
    "kestrel.service.text.commands",
    "kestrel.service.text.handler",
)

# Written in C, each beside the Python twin that stays its reference (docs/architecture.md).
C_HELPERS = (
    "kestrel.storage.fsync._fsync_many",
    "kestrel.storage.kestrel2._codec",
    "kestrel.storage._item",
    "kestrel.storage._crc32c",
    "kestrel.service.thrift._binary",
    "kestrel.service.memcache._scan",
    "kestrel.service._receive",
)


def is_extension(module: str) -> bool:
    """Whether importing `module` loads an extension module rather than its Python source."""
    spec = importlib.util.find_spec(module)
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return spec is not None and spec.origin is not None and spec.origin.endswith(suffixes)


def build_name() -> str:
    """`compiled` where every module of `COMPILED_MODULES` loads compiled, `pure` where none does
    (anything else is a broken build: `mixed`)."""
    compiled = [is_extension(module) for module in COMPILED_MODULES]
    if all(compiled):
        return "compiled"
    return "pure" if not any(compiled) else "mixed"
