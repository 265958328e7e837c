"""Poison items: an item whose reads were aborted `max_errors` times (auto-aborts included) leaves
its queue for good, to its `error_queue` with its data and expiry, or is dropped when none is set.

The queue hands the item over before it closes the read (`hand_over`), so a failure on the way
loses nothing: when the error queue refuses it (full, the item over its `max_item_size`, its journal
unwritable) the abort puts it back at the head instead, and the next abort tries again. The
collection routes it (`route`), and refuses at load and reload an `error_queue` that cannot take
items (`check_error_queues`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from kestrel.storage.config import QueueConfig, QueueConfigs
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import ConfigError, ErrorQueueRefused, InvalidQueueName, KestrelError
from kestrel.storage.filenames import check_queue_name
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
    read is closed, so a failure here loses nothing (at worst, a read closed meanwhile by another
    client leaves a copy in the error queue)."""
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


def check_error_queues(configs: QueueConfigs, aliases: Mapping[str, list[str]]) -> None:
    """Refuse an `error_queue` that is an alias, not a queue name, or the queue itself.

    Checked for every configured queue and for each error queue (which inherits `default_queue`'s
    settings too). Raises ConfigError naming the setting.
    """
    configured = set(configs.configured_names())
    targets = [configs.default.error_queue] + [configs.for_queue(q).error_queue for q in configured]
    names = configured | {t for t in targets if t}
    for name in sorted(names):
        config = configs.for_queue(name)
        target = config.error_queue
        if not config.max_errors or target is None:
            continue
        key = f"queues.{name}.error_queue" if name in configured else "default_queue.error_queue"
        try:
            check_queue_name(target)
        except InvalidQueueName as e:
            raise ConfigError(key, str(e)) from None
        if target in aliases:
            raise ConfigError(key, f"{target!r} is an alias; poison items need a queue")
        if target == name:
            raise ConfigError(key, f"queue {name!r} cannot be its own error queue (set "
                                   f"queues.{name}.max_errors: 0 or another error_queue)")
