"""Taking items out of queues for good, as a write: nothing leaves a queue before a sink holds it.

`drain` runs the streaming source with `Trigger.AvailableNow`: every server is checked before
anything is taken (and one that stops answering while it holds items to take fails the drain),
each micro-batch is logged under the checkpoint, handed to `write`, and its items are confirmed
only once Spark has committed the batch. A drain that fails leaves the items of
the failed batch to return to their queues; run it again with the same checkpoint to go on. A batch
that ran longer than half of `autoAbortMs` before failing had its reads confirmed early: its items
are held in the checkpoint's log alone, and the error says so, naming the checkpoint that delivers
them (a temporary one included), rather than leaving them to be lost with it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from kestrel.pipeline import wal


def drain(spark: Any, servers: str, queue: str, write: Callable[[Any, int], None],
          checkpoint: str | None = None, **options: Any) -> None:
    """Move what the queues hold now into `write(batch_df, batch_id)`, then stop.

    Parameters: `servers` and `queue` as for the source; `checkpoint` a directory to resume from
    (a fresh temporary one by default); other keyword options go to the streaming source
    (`maxItemsPerTrigger`, `autoAbortMs`, ...). Raises what the query raised, with a note naming
    the checkpoint when the failed batch is held in its log alone.
    """
    if not callable(write):  # else found only inside Spark's first batch, as a call of None
        raise TypeError(f"drain: write must be a function of (batch_df, batch_id), got {write!r}")
    temporary = checkpoint is None  # removed at the end, unless it holds items
    location = checkpoint or tempfile.mkdtemp(prefix="kestrel-drain-")
    reader = (spark.readStream.format("kestrel").option("servers", servers).option("queue", queue)
              .option("checkpointLocation", location))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    # Named, so that the Spark UI and each progress report show what it drains (Spark names the
    # source itself after its own class, which a Python source cannot change).
    query = (reader.load().writeStream.queryName(f"kestrel drain of {queue!r}").foreachBatch(write)
             .option("checkpointLocation", location).trigger(availableNow=True).start())
    try:
        query.awaitTermination()  # raises what the query raised
    except Exception as error:
        held = wal.held_early(location)
        if held:
            temporary = False  # the only place those items are
            error.add_note(f"kestrel drain: {held} items of the failed batch are held in the checkpoint's "
                           f"log alone (their reads were confirmed early, as the batch ran longer than half "
                           f"of autoAbortMs); run drain again with checkpoint={location!r} to deliver them")
        raise
    finally:
        if temporary:
            shutil.rmtree(location, ignore_errors=True)
