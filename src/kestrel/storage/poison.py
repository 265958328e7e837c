"""Poison items: an item whose reads were aborted `max_errors` times (auto-aborts included) leaves
its queue for good, to its `error_queue` with its data and expiry, or is dropped when none is set.

The queue hands the item over before it closes the read (`hand_over`), so a failure on the way
loses nothing: when the error queue refuses it (full, the item over its `max_item_size`, its journal
unwritable) the abort puts it back at the head instead, and the next abort tries again. The
collection routes it (`route`), and refuses at load and reload an `error_queue` that cannot take
items (`check_queue_targets`, src/kestrel/storage/config.py).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from kestrel.storage.config import QueueConfig
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import ErrorQueueRefused, KestrelError
from kestrel.storage.item import QItem
from kestrel.storage.runtime import Runtime

log = structlog.get_logger("kestrel.queue")

Put = Callable[[str, list[bytes], int], int]  # the collection's put: (queue, items, expiry) -> accepted
# Takes a poison item: (its queue, that queue's error_queue, the item). Told the queue rather than
# bound to it, so that a queue and its receiver refer to each other in no cycle.
Receiver = Callable[[str, str | None, QItem], None]


def is_poison(item: QItem, config: QueueConfig) -> bool:
    """Whether `item`, just aborted, has been aborted `max_errors` times (0: never poison)."""
    return 0 < config.max_errors <= item.errors


def hand_over(to: Receiver | None, queue: str, error_queue: str | None, item: QItem,
              runtime: Runtime) -> bool:
    """Give poison `item` of `queue` (whose error queue is `error_queue`) to `to` (None drops it);
    False when that refuses it, and the abort returns it to the head instead. Called before the
    read is closed, so a failure here loses nothing; the queue's other changes wait meanwhile
    (`PersistentQueue._hand_over`)."""
    if to is None:
        return True
    try:
        to(queue, error_queue, item)
    except KestrelError as e:
        log_later(runtime, log.warning, "poison item refused by its error queue; back at the head",
                  queue=queue, errors=item.errors, reason=str(e))
        return False
    return True


def route(put: Put, runtime: Runtime, source: str, error_queue: str | None, item: QItem) -> None:
    """Put poison `item` of queue `source` to its `error_queue` with its data and expiry, or drop it
    when none is set; said in the log once the abort's change is over (`log_later`: the change must
    not pause). Raises ErrorQueueRefused, TooManyQueues, JournalWriteError (the source queue then
    returns the item to its head)."""
    if error_queue is None:
        log_later(runtime, log.warning, "poison item dropped: no error_queue", queue=source,
                  errors=item.errors, bytes=len(item.data))
        return
    if not put(error_queue, [item.data], item.expiry):
        raise ErrorQueueRefused(f"error queue {error_queue!r} refused a poison item of {source!r} "
                                f"({len(item.data)} bytes): full, or the item is over max_item_size")
    log_later(runtime, log.info, "poison item moved", queue=source, error_queue=error_queue,
              errors=item.errors)
