"""What the pipeline does to Spark's Python worker process itself, rather than to its rows."""

from __future__ import annotations

import gc

_frozen = False


def spare_collections() -> None:
    """Leave what the worker process holds now out of every later full garbage collection.

    pyspark's daemon runs a full collection after each task a reused worker runs, walking every
    object the process holds: pyspark's and pyarrow's, and once the writer has run, the client's,
    thriftpy2's, the Thrift contract's and structlog's (about 55,000 in all), some 25 ms of CPU a
    task on the cores the tasks share. Those objects are modules and what their import made, alive
    as long as the process: `gc.freeze()` moves them out of the collector's reach, once per process,
    when the writer's first task starts (so the cyclic garbage of that one moment is never freed).
    Every object made later, each task's own, is still collected.
    """
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
