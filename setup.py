"""The optional C helpers; everything else is declared in pyproject.toml.

`optional=True`: where no C compiler is at hand the build goes on without them, and the Python
code each one stands in for serves alone: the group commit uses Python threads
(storage/group_commit.py), items are `storage.item.QItemPython`, the journal readers use
`storage.codec.decode_common_python`, and the Thrift binary protocol its Python list loops
(service/thrift_protocol.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("storage._fsync_many", ["storage/_fsync_many.c"], optional=True),
    Extension("storage._codec", ["storage/_codec.c"], optional=True),
    Extension("storage._item", ["storage/_item.c"], optional=True),
    Extension("service._thrift_binary", ["service/_thrift_binary.c"], optional=True),
])
