"""The optional C helpers; everything else is declared in pyproject.toml.

`optional=True`: where no C compiler is at hand the build goes on without them, and the Python
code each one stands in for serves alone: the group commit uses Python threads
(src/kestrel/storage/fsync/group_commit.py), items are `kestrel.storage.item.QItemPython`, the journal readers
use `kestrel.storage.kestrel2.codec.decode_common_python`, the Thrift binary protocol its Python
list loops (src/kestrel/service/thrift/protocol.py), and the memcache port its Python scanner of pipelined
runs (src/kestrel/service/memcache/runs.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(f"kestrel.{name}", [f"src/kestrel/{name.replace('.', '/')}.c"], optional=True)
    for name in ("storage.fsync._fsync_many", "storage.kestrel2._codec", "storage._item",
                 "service.thrift._binary", "service.memcache._scan")
])
