"""The numbers of the line protocols' arguments (memcache, text), read by their value.

A number is read as Kestrel reads it: its handlers and naggati's memcache codec (the `<bytes>` of a
set) use Scala's `toInt`, Java's `Integer.parseInt`: one `+` or `-`, then decimal digits; no `_`,
no whitespace. Here a `+` is taken everywhere (`+5` is 5, as parseInt reads it since Java 7) and a
`-` only where negative values are (elsewhere, `-0` too is refused). The digits are 0-9 alone:
parseInt would take any script's (`Character.digit`), but Kestrel decodes its lines as ISO-8859-1,
where the UTF-8 bytes of `٣` are two letters, not a digit. Python's int() would read `٣` as 3, and
a memcache `<bytes>` read so would frame the data where no other reader of the line does (its rest
run as commands). A number's width is bounded before int() converts it (a 64 KB line of digits is
never converted), on its significant digits: leading zeros do not count, as memcached's strtoul
and Kestrel's parseInt read `00000000005` as 5.
"""

from __future__ import annotations


def is_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits."""
    return text.isascii() and text.isdigit()


def decimal(text: str, width: int, signed: bool = False) -> int | None:
    """The value of `text`, a `+` (or, when `signed`, a `-`) first or not, with at most `width`
    significant digits; None for anything else."""
    sign = text[:1]
    negative = signed and sign == "-"
    digits = text[1:] if negative or sign == "+" else text
    if not is_digits(digits):
        return None
    significant = digits.lstrip("0")
    if len(significant) > width:
        return None
    value = int(significant) if significant else 0
    return -value if negative else value
