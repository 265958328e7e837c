"""Taking items out of queues for good, as a write: nothing leaves a queue before a sink holds it.

`drain` runs the streaming source with `Trigger.AvailableNow`: every server is checked before
anything is taken, each micro-batch is logged under the checkpoint, handed to `write`, and its
items are confirmed only once Spark has committed the batch. A drain that fails leaves the items of
the failed batch to return to their queues; run it again with the same checkpoint to go on.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any


def drain(spark: Any, servers: str, queue: str, write: Callable[[Any, int], None],
          checkpoint: str | None = None, **options: Any) -> None:
    """Move what the queues hold now into `write(batch_df, batch_id)`, then stop.

    Parameters: `servers` and `queue` as for the source; `checkpoint` a directory to resume from
    (a fresh temporary one by default); other keyword options go to the streaming source
    (`maxItemsPerTrigger`, `autoAbortMs`, ...). Raises what the query raised.
    """
    location = checkpoint or tempfile.mkdtemp(prefix="kestrel-drain-")
    reader = (spark.readStream.format("kestrel").option("servers", servers).option("queue", queue)
              .option("checkpointLocation", location))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    query = (reader.load().writeStream.foreachBatch(write).option("checkpointLocation", location)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    error = query.exception()
    if error is not None:
        raise error
