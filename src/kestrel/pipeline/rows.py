"""Rows of the `kestrel` source, built in bulk as Arrow record batches (far cheaper than tuples)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import BinaryType, StringType, StructField, StructType, TimestampType

QUEUE_SCHEMA = StructType([
    StructField("data", BinaryType(), False),
    StructField("queue", StringType(), False),
    StructField("server", StringType(), False),  # host:port the item came from
    StructField("timestamp", TimestampType(), True),  # when the item was added
    StructField("expiry", TimestampType(), True),  # null: never expires
])

ROWS_PER_BATCH = 10_000
TIMESTAMP = pa.timestamp("us", tz="UTC")  # Spark's TimestampType in Arrow
_QUEUE_ARROW = pa.schema([pa.field("data", pa.binary(), False), pa.field("queue", pa.string(), False),
                          pa.field("server", pa.string(), False), pa.field("timestamp", TIMESTAMP),
                          pa.field("expiry", TIMESTAMP)])

# Arrow scalars, not Python numbers: pyarrow.compute converts a Python number by first trying to
# import numpy, a search of sys.path on every call where numpy is not installed.
_THOUSAND = pa.scalar(1000, pa.int64())
_ZERO = pa.scalar(0, pa.int64())
# The times a collect into Python shows in any time zone (ms since the epoch): the years 1 to 9999
# of Spark's TimestampType and Python's datetime, less two days at each end (a zone's offset, and
# the day before that Python's conversion to local time looks at).
_EARLIEST_MS = pa.scalar(-62_135_596_800_000 + 2 * 86_400_000, pa.int64())
_LATEST_MS = pa.scalar(253_402_300_799_999 - 2 * 86_400_000, pa.int64())


def timestamps(ms: Any) -> Any:
    """Milliseconds since the epoch (0: no time, a null; a list or an int64 array) as Spark's
    TimestampType in Arrow, built in bulk: the values multiplied in one call, the nulls a bitmap of
    the zeros. A time beyond what a collect shows (a damaged journal field) shows as the nearer end
    of that range: multiplied as it was, it wrapped around to another time or to no time, or failed
    the collect ("year out of range")."""
    given = ms if isinstance(ms, pa.Array) else pa.array(ms, pa.int64())
    known = pc.not_equal(given, _ZERO)
    bounded = pc.min_element_wise(pc.max_element_wise(given, _EARLIEST_MS), _LATEST_MS)
    micros = pc.multiply(bounded, _THOUSAND)
    return pa.Array.from_buffers(TIMESTAMP, len(micros), [known.buffers()[1], micros.buffers()[1]])


def queue_rows(items: list[bytes], queue: str, server: str, added: list[int] | None = None,
               expiry: list[int] | None = None) -> Iterator[Any]:
    """The rows of items taken from one queue on one server; `added` and `expiry` are each item's
    times in ms (expiry 0: never), None where they are not known (a log written by an older version)."""
    for first in range(0, len(items), ROWS_PER_BATCH):
        chunk = items[first:first + ROWS_PER_BATCH]
        n = len(chunk)
        unknown = pa.nulls(n, TIMESTAMP)
        yield pa.RecordBatch.from_arrays(
            [pa.array(chunk, pa.binary()), pa.array([queue] * n, pa.string()),
             pa.array([server] * n, pa.string()),
             unknown if added is None else timestamps(added[first:first + n]),
             unknown if expiry is None else timestamps(expiry[first:first + n])],
            schema=_QUEUE_ARROW)
