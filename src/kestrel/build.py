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

# Compiled by mypyc from their Python source: the request path from the protocols' connection loops
# and codecs through the session, the collection and the queue policy to both formats' queues,
# journals, journal files and record codecs. Beside it stay Python, each for a reason:
# `storage.disk`, the system calls the fault tests replace to fail a write or an fsync (a compiled
# module's own functions are called directly, so a replacement would not be seen); `storage.runtime`,
# reached only through the `Runtime` protocol (calls on gevent) and subclassed by tests (its lock
# for gevent, `storage.no_lock`, is compiled: every change takes it); and `storage.item`, the
# Python twin of the C helper `_item` (a get's `TakenItems` live in `storage.taken_items`). Off the
# request path, `storage.torn_tail` is compiled too: start-up may judge megabytes of a torn record
# with it, a step per place where a record could start.
COMPILED_MODULES = (
    "kestrel.service.socket_io",
    "kestrel.service.turns",
    "kestrel.service.buffered_connection",
    "kestrel.service.numerals",
    "kestrel.service.histogram_series",
    "kestrel.service.replies",
    "kestrel.service.thrift.protocol",
    "kestrel.service.thrift.messages",
    "kestrel.service.thrift.transport",
    "kestrel.service.thrift.handler",
    "kestrel.service.memcache.commands",
    "kestrel.service.memcache.runs",
    "kestrel.service.memcache.handler",
    "kestrel.service.text.commands",
    "kestrel.service.text.handler",
    "kestrel.service.session.auto_abort",
    "kestrel.service.session.open_reads",
    "kestrel.service.session.read_ids",
    "kestrel.service.session.server_state",
    "kestrel.service.session.session",
    "kestrel.service.session.stats",
    "kestrel.service.session.status",
    "kestrel.storage.acknowledgements",
    "kestrel.storage.aliases",
    "kestrel.storage.changes",
    "kestrel.storage.clock",
    "kestrel.storage.collection",
    "kestrel.storage.commit_log",
    "kestrel.storage.config",
    "kestrel.storage.deferred_log",
    "kestrel.storage.expiry",
    "kestrel.storage.fsync.group_commit",
    "kestrel.storage.fanout",
    "kestrel.storage.journal_file",
    "kestrel.storage.memory",
    "kestrel.storage.no_lock",
    "kestrel.storage.poison",
    "kestrel.storage.queue",
    "kestrel.storage.read_behind",
    "kestrel.storage.shared_fsync",
    "kestrel.storage.taken_items",
    "kestrel.storage.timing",
    "kestrel.storage.torn_tail",
    "kestrel.storage.wait_list",
    "kestrel.storage.write_gate",
    "kestrel.storage.kestrel2.codec",
    "kestrel.storage.kestrel2.journal",
    "kestrel.storage.kestrel2.queue",
    "kestrel.storage.kestrel2.read_behind",
    "kestrel.storage.kestrel2.reader",
    "kestrel.storage.kestrel3.codec",
    "kestrel.storage.kestrel3.files",
    "kestrel.storage.kestrel3.journal",
    "kestrel.storage.kestrel3.queue",
)

# Written in C, each beside the Python twin that stays its reference (docs/architecture.md).
C_HELPERS = (
    "kestrel.storage.fsync._fsync_many",
    "kestrel.storage.kestrel2._codec",
    "kestrel.storage.kestrel3._codec",
    "kestrel.storage._item",
    "kestrel.storage._crc32c",
    "kestrel.storage._log_record",
    "kestrel.storage._disk",
    "kestrel.storage._clock",
    "kestrel.service.thrift._binary",
    "kestrel.service.memcache._scan",
    "kestrel.service._receive",
)

# The libraries a helper links with (zlib's CRC-32 is the commit log record's checksum, as Python's
# `zlib.crc32` is its reference's): where one is missing, that helper is not built.
C_LIBRARIES = {"kestrel.storage._log_record": ["z"]}


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
