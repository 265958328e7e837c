"""What the pipeline does to Spark's Python worker processes themselves, rather than to its rows."""

from __future__ import annotations

import gc
import sys

_frozen = False


def spare_collections() -> None:
    """Leave what this process holds now out of every later full garbage collection, once, in a
    process pyspark's daemon forked; elsewhere (a driver, a test calling the writer) do nothing.

    pyspark's daemon runs a full collection after each request a reused worker serves (a task, or
    planning or committing a write), walking every object the process holds: pyspark's and pyarrow's,
    and once a source or the writer has been loaded, the client's, thriftpy2's, the Thrift contract's and
    structlog's (about 55,000 in all), some 25 ms of CPU a task on the cores the tasks share. Those
    objects are modules and what their import made, alive as long as the process: `gc.freeze()`
    moves them out of the collector's reach (with the cyclic garbage of that one moment, never
    freed). Every object made later, each task's own, is still collected.
    """
    global _frozen
    if not _frozen and _forked_by_pyspark_daemon():
        _frozen = True
        gc.freeze()


def _forked_by_pyspark_daemon() -> bool:
    """Whether this process runs pyspark's daemon (`python -m pyspark.daemon`): the one that collects
    after every request. Without the daemon, each worker serves one task and exits."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "pyspark.daemon"
