"""The compiled run decoder (src/kestrel/storage/kestrel2/_codec.c) against the Python loop it stands in for.

Both read journals of every record kind, with item data full of bytes that read as opcodes (so the
flipped-bit size check calls `misplaced_end`), from every starting position, under budgets that cut
runs anywhere, and after random bytes are overwritten, cut off or flipped: the runs, the positions
they stop at and the last sized record must be the same, as tuples and as column buffers.
"""

from __future__ import annotations

import random
import shutil

import pytest

from kestrel.storage.kestrel2 import codec
from tests.storage.test_replay_fast_path import random_journal
from tests.support.damaged_bytes import damaged

try:
    from kestrel.storage.kestrel2 import _codec as compiled
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    pytest.skip("built without a C compiler", allow_module_level=True)


def journal_bytes(seed: int, count: int = 120) -> bytes:
    return b"".join(codec.encode(r) for r in random_journal(random.Random(seed), count))


def both(buf: bytes, pos: int, budget: int, check_sizes: bool) -> None:
    base = 1 << 33  # offsets past 4 GiB: the file offset is added as a 64-bit number
    expected = codec.decode_common_python(buf, pos, base, budget, check_sizes)
    assert compiled.decode_common(buf, pos, base, budget, check_sizes, codec.misplaced_end) == expected
    columns = compiled.decode_common_columns(buf, pos, base, budget, check_sizes, codec.misplaced_end)
    assert columns == codec.decode_common_columns_python(buf, pos, base, budget, check_sizes)
    assert columns[0][0] == len(expected[0])


@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_runs_are_the_python_runs(seed: int) -> None:
    rng = random.Random(seed)
    buf = journal_bytes(seed)
    for pos in range(0, len(buf), 7):
        both(buf, pos, rng.choice((-5, 0, 1, 50, 300, 1 << 40)), rng.random() < 0.7)
    for _ in range(60):
        broken = damaged(rng, buf)
        both(broken, rng.randrange(len(broken) // 4), rng.choice((100, 1 << 40)), True)


def test_a_record_the_size_check_questions_ends_the_run_in_both() -> None:
    # An ADDX whose size has one bit too many swallows the records after it: `misplaced_end` finds
    # its real end, so with the size check both decoders stop before it instead of reading it whole.
    good = codec.encode_addx(1, 0, b"a" * 20)
    buf = bytearray(good * 5 + codec.REMOVE_BYTES * 2)
    size = int.from_bytes(buf[1:5], "little")
    buf[1:5] = (size | 128).to_bytes(4, "little")
    swallowed = bytes(buf)
    assert codec.misplaced_end(swallowed, 0, 21 + (size | 128) - 16) == len(good)
    assert codec.decode_common_python(swallowed, 0, 0, 1 << 40, True)[:2] == ([], 0)
    assert codec.decode_common_python(swallowed, 0, 0, 1 << 40, False)[1] > 5 * len(good) - 128
    for check_sizes in (True, False):
        both(swallowed, 0, 1 << 40, check_sizes)


def test_an_error_in_the_size_check_reaches_the_caller() -> None:
    buf = codec.encode_addx(1, 0, b"\x01" * 20) * 3

    def failing(_buf: bytes, _pos: int, _limit: int) -> int | None:
        raise RuntimeError("size check failed")

    for decode in (compiled.decode_common, compiled.decode_common_columns):
        with pytest.raises(RuntimeError, match="size check failed"):
            decode(buf, 0, 0, 1 << 40, True, failing)


def test_the_columns_are_arrow_buffers_of_the_run() -> None:
    pa = pytest.importorskip("pyarrow")
    rng = random.Random(3)
    common = [codec.AddX(rng.randrange(2**40), rng.choice((0, 2**41)), rng.randbytes(rng.randrange(50))),
              codec.AddXid(rng.randrange(1, 2**31), 5, 0, b"x"), codec.Remove(), codec.ConfirmRemove(-3),
              codec.RemoveTentativeXid(2**31 - 1)]
    buf = b"".join(codec.encode(rng.choice(common)) for _ in range(200)) + codec.REMOVE_BYTES * 2
    run, _, _ = codec.decode_common(buf, 0, 0, 1 << 40, False)
    (n, ops, offsets, xids, added, expiry, ends, data), _, _ = codec.decode_common_columns(
        buf, 0, 0, 1 << 40, False)
    assert n == len(run) == 201
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(ends), pa.py_buffer(data)])
    assert values.to_pylist() == [r[5] for r in run]
    for column, kind, index in ((ops, pa.int8(), 0), (offsets, pa.int64(), 1), (xids, pa.int32(), 2),
                                (added, pa.int64(), 3), (expiry, pa.int64(), 4)):
        assert pa.Array.from_buffers(kind, n, [None, pa.py_buffer(column)]).to_pylist() == \
            [r[index] for r in run]
