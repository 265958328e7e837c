"""Random damage to a journal's bytes, for the tests that compare a compiled decoder with its Python
reference on what a disk or a crash may leave."""

from __future__ import annotations

import random


def damaged(rng: random.Random, buf: bytes) -> bytes:
    """`buf` with a few bytes overwritten or a bit flipped (a size field's among them), and its tail cut."""
    out = bytearray(buf)
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(out))
        if rng.random() < 0.5:
            out[at] = rng.randrange(256)
        else:
            out[at] ^= 1 << rng.randrange(8)
    return bytes(out[:rng.randrange(len(out) // 2, len(out) + 1)])
