"""The numbers of the line protocols' arguments (memcache, text), read by their value.

A number is the ASCII digits 0-9 alone, after a `-` where negative values are taken: Python's int()
would also take `+`, `_`, surrounding whitespace and other scripts' digits (`٣` is 3), which no
client means. Its width is bounded before int() converts it (a 64 KB line of digits is never
converted), on its significant digits: leading zeros do not count, as memcached's strtoul and
Kestrel's parseInt read `00000000005` as 5.
"""

from __future__ import annotations


def is_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits."""
    return text.isascii() and text.isdigit()


def decimal(text: str, width: int, signed: bool = False) -> int | None:
    """The value of `text` (a `-` first when `signed`) with at most `width` significant digits, or
    None for anything else."""
    negative = signed and text.startswith("-")
    digits = text[1:] if negative else text
    if not is_digits(digits):
        return None
    significant = digits.lstrip("0")
    if len(significant) > width:
        return None
    value = int(significant) if significant else 0
    return -value if negative else value
