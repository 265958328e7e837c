"""The optional C helpers; everything else is declared in pyproject.toml.

`optional=True`: where no C compiler is at hand the build goes on without them, and the Python
code each one stands in for serves alone: the group commit uses Python threads
(storage/fsync/group_commit.py), items are `kestrel.storage.item.QItemPython`, the journal readers
use `kestrel.storage.kestrel2.codec.decode_common_python`, the Thrift binary protocol its Python
list loops (service/thrift/protocol.py), and the memcache port its Python scanner of pipelined runs
(service/memcache/runs.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kestrel.storage.fsync._fsync_many", ["storage/fsync/_fsync_many.c"], optional=True),
    Extension("kestrel.storage.kestrel2._codec", ["storage/kestrel2/_codec.c"], optional=True),
    Extension("kestrel.storage._item", ["storage/_item.c"], optional=True),
    Extension("kestrel.service.thrift._binary", ["service/thrift/_binary.c"], optional=True),
    Extension("kestrel.service.memcache._scan", ["service/memcache/_scan.c"], optional=True),
])
