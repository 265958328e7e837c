"""What the pipeline does to Spark's Python worker processes themselves, rather than to its rows."""

from __future__ import annotations

import gc
import signal
import sys
import threading
from types import FrameType

_frozen = False
_stopping = False  # the stream source's stop() has begun, or a SIGTERM is taking the runner there


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
    if not _frozen and _main_module() == "pyspark.daemon":
        _frozen = True
        gc.freeze()


def _main_module() -> str | None:
    """The module this process runs as `python -m`: `pyspark.daemon` for pyspark's daemon, the one
    that collects after every request (without it, each worker serves one task and exits), or the
    runner of a stream source in the driver's Python process."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return name if isinstance(name, str) else None


def stop_source_when_terminated() -> None:
    """In the process where Spark's driver runs a Python stream source, make SIGTERM end it as the
    end of its input would; elsewhere (a test calling the source) do nothing.

    When a query stops, Spark 4.3 ends that process with SIGTERM, which by default ends it at once:
    pyspark's runner never reaches its `finally: reader.stop()`, and a batch the sink had just
    committed stayed open on the servers, to be delivered again after autoAbortMs. Raised as
    SystemExit in the runner's thread, the signal unwinds it through that `stop()`, unless that
    `stop()` has begun (`source_stopping`)."""
    if (_main_module() == "pyspark.sql.streaming.python_streaming_source_runner"
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGTERM, _exit)


def source_stopping() -> None:
    """The source's `stop()` has begun: a SIGTERM from now on lets it finish (the runner ends the
    process after it). Raised in the middle of it, as the end of the runner's input and the signal
    come together when a query stops, the SystemExit cut its confirms short, and the batch the sink
    had just committed came back after autoAbortMs."""
    global _stopping
    _stopping = True


def _exit(signum: int, frame: FrameType | None) -> None:
    """The first SIGTERM unwinds the runner into `stop()`; any later one, as Spark sends a second
    when it stops the source's workers, lets it get there: raised before `stop()` had begun, its
    SystemExit skipped the confirms altogether."""
    global _stopping
    if not _stopping:
        _stopping = True
        raise SystemExit(128 + signum)
