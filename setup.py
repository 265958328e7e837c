"""The optional C helpers; everything else is declared in pyproject.toml.

`optional=True`: where no C compiler is at hand the build goes on without them, and the Python
code each one stands in for serves alone: the group commit uses Python threads
(src/kestrel/storage/fsync/group_commit.py), items are `kestrel.storage.item.QItemPython`, CRC32C
is `kestrel.storage.crc32c.crc32c_python`, the journal readers use
`kestrel.storage.kestrel2.codec.decode_common_python`, the Thrift binary protocol its Python
readers and writers (src/kestrel/service/thrift/protocol.py), and the memcache port parses each
command alone (src/kestrel/service/memcache/runs.py). `make sanitize` builds them under
AddressSanitizer and UBSan and runs their tests.

It also puts `src/kestrel-pyspark-python.pth` at the top of the built package, beside the modules,
so that an install places it in site-packages, where Python reads it at start-up (see
src/kestrel_pyspark_python.py); setuptools declares no such file in pyproject.toml.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "kestrel-pyspark-python.pth"


class BuildWithPth(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithPth}, ext_modules=[
    Extension(f"kestrel.{name}", [f"src/kestrel/{name.replace('.', '/')}.c"], optional=True)
    for name in ("storage.fsync._fsync_many", "storage.kestrel2._codec", "storage._item", "storage._crc32c",
                 "service.thrift._binary", "service.memcache._scan")
])
