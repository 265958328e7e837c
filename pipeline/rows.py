"""Rows of the `kestrel` source, built in bulk as Arrow record batches (far cheaper than tuples)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.types import BinaryType, StringType, StructField, StructType

QUEUE_SCHEMA = StructType([
    StructField("data", BinaryType(), False),
    StructField("queue", StringType(), False),
    StructField("server", StringType(), False),  # host:port the item came from
])

ROWS_PER_BATCH = 10_000


def queue_rows(items: list[bytes], queue: str, server: str) -> Iterator[Any]:
    import pyarrow as pa

    schema = pa.schema([pa.field("data", pa.binary(), False), pa.field("queue", pa.string(), False),
                        pa.field("server", pa.string(), False)])
    for first in range(0, len(items), ROWS_PER_BATCH):
        chunk = items[first:first + ROWS_PER_BATCH]
        yield pa.RecordBatch.from_arrays(
            [pa.array(chunk, pa.binary()), pa.array([queue] * len(chunk), pa.string()),
             pa.array([server] * len(chunk), pa.string())],
            schema=schema)
