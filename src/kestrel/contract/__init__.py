"""Kestrel's Thrift contract, shipped inside the package so that an installed wheel can load it.

The server, the client, the Spark pipeline, the tests and the benchmarks all import `kestrel_thrift`
from here. It is loaded once, under a fixed module name, so that its structs pickle (Spark ships
them between processes).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import thriftpy2

IDL_PATH = Path(str(resources.files(__name__).joinpath("kestrel.thrift")))

kestrel_thrift = thriftpy2.load(str(IDL_PATH), module_name="kestrel_thrift")

__all__ = ["IDL_PATH", "kestrel_thrift"]
