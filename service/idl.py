"""Kestrel's Thrift contract, loaded once so that its structs pickle (Spark ships them)."""

from __future__ import annotations

from pathlib import Path

import thriftpy2

IDL_PATH = Path(__file__).resolve().parent.parent / "kestrel.thrift"

kestrel_thrift = thriftpy2.load(str(IDL_PATH), module_name="kestrel_thrift")
