"""Replay's fast paths for common records (`codec.decode_common`, `QueueReplay.apply_common`, and in
read-behind `apply_behind`) against the general path they shortcut: the read-only replay decodes
every record one by one.

Journals mix every record kind, item data full of bytes that read as opcodes (so the flipped-bit
size check runs its full form), and reads in tiny chunks (so runs stop at every buffer edge).
"""

from __future__ import annotations

import os
import random

import pytest

from kestrel.storage import QueueCollection, QueueConfigs, journal_file
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.codec import (
    Add,
    AddX,
    AddXid,
    ConfirmRemove,
    Record,
    Remove,
    RemoveTentative,
    RemoveTentativeXid,
    SaveXid,
    Unremove,
)
from kestrel.storage.kestrel2.replay import is_next_free_xid, next_free_xid, replay_queue
from tests.support.queues import one


def random_journal(rng: random.Random, count: int) -> list[Record]:
    """Records as a live queue might write them, and some with nothing to act on."""
    records: list[Record] = []
    xid = 0
    for _ in range(count):
        data = bytes(rng.choice(b"\x00\x01\x02\x07\x08\x09ab") for _ in range(rng.randrange(40)))
        kind = rng.randrange(10)
        if kind < 4:
            records.append(AddX(1000 + len(records), rng.choice((0, 2**50)), data))
        elif kind == 4:
            records.append(AddXid(rng.randrange(1, 50), 7, 0, data) if rng.random() < 0.5 else Add(0, data))
        elif kind == 5:
            records.append(Remove())
        elif kind == 6:
            xid += 1
            records.append(RemoveTentativeXid(xid if rng.random() < 0.9 else xid + 3))
        elif kind == 7:
            records.append(ConfirmRemove(rng.randrange(1, xid + 2)))
        elif kind == 8:
            records.append(Unremove(rng.randrange(1, xid + 2)))
        else:
            records.append(RemoveTentative() if rng.random() < 0.5 else SaveXid(xid))
    return records


@pytest.mark.parametrize("memory", ["128MB", "300", "0"])  # all in memory; mostly read-behind
@pytest.mark.parametrize("seed", range(6))
def test_fast_replay_serves_what_the_record_by_record_replay_rebuilds(
        tmp_path: object, seed: int, memory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = str(tmp_path)
    rng = random.Random(seed)
    with open(os.path.join(directory, "q"), "wb") as f:
        f.write(b"".join(codec.encode(r) for r in random_journal(rng, 3000)))
    expected = replay_queue(directory, "q")
    monkeypatch.setattr(journal_file, "READ_CHUNK", rng.choice((7, 64, 1000)))
    coll = QueueCollection(directory, QueueConfigs({"max_memory_size": memory}))
    coll.load()
    q = coll.queue("q")
    assert (q.length, q.bytes) == (len(expected.restart_order()),
                                   sum(len(i.data) for i in expected.restart_order()))
    served = [one(q.remove()) for _ in range(q.length)]
    assert [(i.data, i.expiry) for i in served if i] == [(i.data, i.expiry) for i in expected.restart_order()]
    coll.close()



def test_whether_an_xid_is_the_next_free_one_is_the_walks_answer() -> None:
    """`is_next_free_xid` answers as `next_free_xid` does, around 0 and the i32 wrap included."""
    rng = random.Random(7)
    for _ in range(20_000):
        centre = rng.choice([0, 2**31 - 1, -2**31, 1000])
        opens: dict[int, object] = {}
        for _ in range(rng.randrange(8)):
            opens[(centre + rng.randrange(-4, 6) + 2**31) % 2**32 - 2**31] = None
        last = (centre + rng.randrange(-5, 3) + 2**31) % 2**32 - 2**31
        xid = (centre + rng.randrange(-6, 10) + 2**31) % 2**32 - 2**31
        assert is_next_free_xid(xid, last, opens) == (next_free_xid(last, opens) == xid), (xid, last, opens)  # type: ignore[arg-type]


def test_a_journal_opening_xids_in_descending_order_replays_without_walking_the_open_ones(
        tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each open asked for the next free xid after the last, walking every open xid above it:
    5,000 opens took 12.5 million steps (a 540 KB journal loaded in 20 s)."""
    from kestrel.storage.kestrel2 import replay

    n = 5_000
    records: list[Record] = [AddX(1, 0, b"x") for _ in range(n)]
    records += [RemoveTentativeXid(xid) for xid in range(n, 0, -1)]
    path = os.path.join(tmp_path, "q")
    with open(path, "wb") as f:
        f.write(b"".join(map(codec.encode, records)))
    asked = 0

    class CountedOpens(dict):  # type: ignore[type-arg]
        def __contains__(self, xid: object) -> bool:
            nonlocal asked
            asked += 1
            return super().__contains__(xid)

    class CountedReplay(replay.QueueReplay):
        def __init__(self) -> None:
            super().__init__()
            self.opens = CountedOpens()

    monkeypatch.setattr(replay, "QueueReplay", CountedReplay)
    rebuilt = replay_queue(str(tmp_path), "q")
    assert len(rebuilt.opens) == n and rebuilt.anomalies["xid_jumps"] == n
    assert asked <= 2 * n
