"""Poison items as a library: an item aborted `max_errors` times leaves its queue for `error_queue`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import ConfigError
from kestrel.storage.kestrel2.replay import replay_queue
from tests.support.queues import drain, one, reopen

T0 = 1_700_000_000_000


def make(tmp_path: Path, queues: dict | None = None, default: dict | None = None,
         aliases: dict | None = None) -> QueueCollection:
    coll = QueueCollection(str(tmp_path), QueueConfigs(default, queues), aliases, FakeClock(T0))
    coll.load()
    return coll


def abort_head(coll: QueueCollection, name: str) -> bytes:
    """Open a read of the head item and abort it; the item's data."""
    item = one(coll.remove(name, transaction=True))
    assert item is not None
    assert coll.unremove(name, [item.xid])
    return item.data


def test_item_aborted_max_errors_times_moves_to_the_error_queue_with_its_expiry(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 3, "error_queue": "failed"}})
    coll.put("jobs", [b"bad"], T0 + 60_000)
    coll.put("jobs", [b"good"])
    for _ in range(2):
        assert abort_head(coll, "jobs") == b"bad"
    q = coll.queue("jobs")
    assert q.length == 2 and q.stats()["poisoned"] == 0
    assert abort_head(coll, "jobs") == b"bad"
    assert q.length == 1 and q.open_transactions == 0
    assert q.stats()["poisoned"] == 1 and q.stats()["canceled_transactions"] == 3
    moved = one(coll.remove("failed"))
    assert moved is not None and moved.data == b"bad" and moved.expiry == T0 + 60_000
    assert drain(coll, "jobs") == [b"good"]


def test_poison_is_journaled_as_a_confirm_so_a_restart_does_not_bring_it_back(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 1, "error_queue": "failed"}})
    coll.put("jobs", [b"bad", b"next"])
    abort_head(coll, "jobs")
    assert [i.data for i in replay_queue(str(tmp_path), "jobs").restart_order()] == [b"next"]
    coll = reopen(coll)
    assert drain(coll, "jobs") == [b"next"]
    assert drain(coll, "failed") == [b"bad"]


def test_without_error_queue_poison_is_dropped(tmp_path: Path) -> None:
    coll = make(tmp_path, default={"max_errors": 2})
    coll.put("jobs", [b"bad", b"good"])
    abort_head(coll, "jobs")
    abort_head(coll, "jobs")
    assert coll.queue("jobs").stats()["poisoned"] == 1
    assert drain(coll, "jobs") == [b"good"]
    assert coll.queue_names() == ["jobs"]


def test_max_errors_zero_never_poisons(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"error_queue": "failed"}})
    coll.put("jobs", [b"x"])
    for _ in range(20):
        abort_head(coll, "jobs")
    assert coll.queue("jobs").stats()["poisoned"] == 0 and coll.get("failed") is None


def test_batch_abort_poisons_only_items_at_the_limit_and_keeps_the_others_in_order(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 2, "error_queue": "failed"}})
    coll.put("jobs", [b"a", b"b", b"c"])
    first = one(coll.remove("jobs", transaction=True))
    assert first is not None and coll.unremove("jobs", [first.xid])  # a: one error
    reads = coll.remove("jobs", 3, transaction=True)
    assert [r.data for r in reads] == [b"a", b"b", b"c"]
    assert coll.unremove("jobs", [r.xid for r in reversed(reads)]) == 3
    assert drain(coll, "jobs") == [b"b", b"c"]
    assert drain(coll, "failed") == [b"a"]


def test_a_full_error_queue_leaves_the_item_at_the_head_and_nothing_is_lost(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 1, "error_queue": "failed"}, "failed": {"max_items": 1}})
    coll.put("failed", [b"already there"])
    coll.put("jobs", [b"bad", b"next"])
    abort_head(coll, "jobs")
    q = coll.queue("jobs")
    assert q.stats()["poisoned"] == 0 and q.length == 2
    coll.remove("failed")
    abort_head(coll, "jobs")  # the error queue has room again
    assert q.stats()["poisoned"] == 1
    assert drain(coll, "failed") == [b"bad"]
    assert drain(coll, "jobs") == [b"next"]


def test_a_confirmed_item_is_never_poisoned(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 2, "error_queue": "failed"}})
    coll.put("jobs", [b"x"])
    abort_head(coll, "jobs")
    item = one(coll.remove("jobs", transaction=True))
    assert item is not None and coll.confirm("jobs", [item.xid])
    assert not coll.unremove("jobs", [item.xid])
    assert coll.get("failed") is None and coll.queue("jobs").length == 0


def test_error_count_lives_in_memory_for_kestrel2_journals(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 2, "error_queue": "failed"}})
    coll.put("jobs", [b"x"])
    abort_head(coll, "jobs")
    coll = reopen(coll)
    abort_head(coll, "jobs")  # the count restarted at 0: this is the first error again
    assert coll.get("failed") is None
    abort_head(coll, "jobs")
    assert drain(coll, "failed") == [b"x"]


@pytest.mark.parametrize("queues, default, aliases, message", [
    ({"jobs": {"max_errors": 1, "error_queue": "jobs"}}, None, None,
     "queues.jobs.error_queue: queue 'jobs' cannot be its own error queue"),
    ({"jobs": {"max_errors": 1, "error_queue": "both"}}, None, {"both": ["a", "b"]},
     "queues.jobs.error_queue: 'both' is an alias"),
    ({"jobs": {"max_errors": 1, "error_queue": "a/b"}}, None, None,
     "queues.jobs.error_queue: queue name 'a/b' contains '/'"),
    (None, {"max_errors": 3, "error_queue": "failed"}, None,
     "default_queue.error_queue: queue 'failed' cannot be its own error queue (set queues.failed.max_errors: 0"),
])
def test_bad_error_queue_is_a_config_error_at_start(tmp_path: Path, queues: dict | None, default: dict | None,
                                                    aliases: dict | None, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        make(tmp_path, queues, default, aliases)
    assert str(raised.value).startswith(message)


def test_default_error_queue_works_once_the_error_queue_turns_it_off(tmp_path: Path) -> None:
    coll = make(tmp_path, {"failed": {"max_errors": 0}}, {"max_errors": 1, "error_queue": "failed"})
    coll.put("jobs", [b"x"])
    abort_head(coll, "jobs")
    assert drain(coll, "failed") == [b"x"]


def test_reload_refuses_a_bad_error_queue_and_keeps_the_settings(tmp_path: Path) -> None:
    coll = make(tmp_path, {"jobs": {"max_errors": 1, "error_queue": "failed"}})
    with pytest.raises(ConfigError):
        coll.reload(QueueConfigs(None, {"jobs": {"max_errors": 1, "error_queue": "jobs"}}), {})
    assert coll.configs.for_queue("jobs").error_queue == "failed"
