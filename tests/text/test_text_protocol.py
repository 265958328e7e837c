"""The text protocol's parser, without sockets: every line is a command, nothing, or a named error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kestrel.service.text.commands import TextCommand, TextError, parse_line


@pytest.mark.parametrize("line, command", [
    (b"put q:", TextCommand("put", queue="q")),
    (b"put q 1500:", TextCommand("put", queue="q", expiry_ms=1500)),
    (b"put q -1:", TextCommand("put", queue="q", expiry_ms=-1)),
    (b"PUT q :", TextCommand("put", queue="q")),
    (b"get q", TextCommand("get", queue="q")),
    (b"get q 250", TextCommand("get", queue="q", timeout_ms=250)),
    (b"peek q 10", TextCommand("peek", queue="q", timeout_ms=10)),
    (b"monitor q 500", TextCommand("monitor", queue="q", timeout_ms=500)),
    (b"monitor q 500 3", TextCommand("monitor", queue="q", timeout_ms=500, count=3)),
    (b"confirm q 2", TextCommand("confirm", queue="q", count=2)),
    (b"flush q", TextCommand("flush", queue="q")),
    (b"delete q", TextCommand("delete", queue="q")),
    (b"status", TextCommand("status")),
    (b"status readonly", TextCommand("status", status="readonly")),
    (b"version", TextCommand("version")),
    (b"quit", TextCommand("quit")),
    (b"shutdown", TextCommand("shutdown")),
    # A number is judged by its value: leading zeros are not counted against its width, as Kestrel's
    # parseInt reads them.
    (b"get q 0000000000000000000250", TextCommand("get", queue="q", timeout_ms=250)),
    (b"put q -0000000000000000000001:", TextCommand("put", queue="q", expiry_ms=-1)),
    (b"confirm q 00000000000000000000002", TextCommand("confirm", queue="q", count=2)),
    # A `+` first is taken wherever a number is, as Kestrel's toInt (Java's parseInt) takes it.
    (b"put q +1500:", TextCommand("put", queue="q", expiry_ms=1500)),
    (b"get q +250", TextCommand("get", queue="q", timeout_ms=250)),
    (b"peek q +0", TextCommand("peek", queue="q", timeout_ms=0)),
    (b"monitor q +500 +3", TextCommand("monitor", queue="q", timeout_ms=500, count=3)),
    (b"confirm q +2", TextCommand("confirm", queue="q", count=2)),
    (b"get q +0000000000000000000250", TextCommand("get", queue="q", timeout_ms=250)),
])
def test_lines_parse_to_commands(line: bytes, command: TextCommand) -> None:
    assert parse_line(line) == command


# Kestrel's TextHandler reads its arguments by position (`request.args(0)`, `args.drop(1).headOption`)
# and parses numbers with `toInt`: words after the ones a command takes are ignored, numbers may be
# negative (a past deadline: no wait; a confirm count of none).
@pytest.mark.parametrize("line, command", [
    (b"put q 1500 extra:", TextCommand("put", queue="q", expiry_ms=1500)),
    (b"put my 5 queue:", TextCommand("put", queue="my", expiry_ms=5)),
    (b"get q -5", TextCommand("get", queue="q", timeout_ms=-5)),
    (b"get q 250 later", TextCommand("get", queue="q", timeout_ms=250)),
    (b"peek q -1 x", TextCommand("peek", queue="q", timeout_ms=-1)),
    (b"monitor q -500", TextCommand("monitor", queue="q", timeout_ms=-500)),
    (b"monitor q 500 3 more", TextCommand("monitor", queue="q", timeout_ms=500, count=3)),
    (b"confirm q -2", TextCommand("confirm", queue="q", count=-2)),
    (b"confirm q 2 extra", TextCommand("confirm", queue="q", count=2)),
    (b"flush q extra", TextCommand("flush", queue="q")),
    (b"delete q extra", TextCommand("delete", queue="q")),
    (b"status readonly now", TextCommand("status", status="readonly")),
    (b"version please", TextCommand("version")),
    (b"quit now", TextCommand("quit")),
    (b"shutdown now", TextCommand("shutdown")),
])
def test_extra_words_are_ignored_and_numbers_may_be_negative(line: bytes, command: TextCommand) -> None:
    assert parse_line(line) == command


@pytest.mark.parametrize("line, message, opens_block", [
    (b"put my queue:", "Error parsing expiration time.", True),
    (b"put q", "usage: put <queue> [expiry-ms]: then one item per line, then an empty line", True),
    (b"put :", "Queue name required.", True),
    (b"put q soon:", "Error parsing expiration time.", True),
    (b"put \xff:", "command line is not valid UTF-8", True),
    (b"put:", "Queue name required.", True),
    (b"get q:", "usage: put <queue> [expiry-ms]: then one item per line, then an empty line", True),
    (b"get", "Queue name required.", False),
    (b"get q later", "Error parsing timeout.", False),
    (b"get q --5", "Error parsing timeout.", False),
    (b"get q 5.0", "Error parsing timeout.", False),
    (b"put q 1x extra:", "Error parsing expiration time.", True),
    (b"peek", "Queue name required.", False),
    (b"monitor q 10 lots", "Error parsing max items.", False),
    (b"delete", "Queue name required.", False),
    (b"monitor q", "Queue name & timeout required.", False),
    (b"monitor q nan", "Error parsing timeout.", False),
    (b"confirm q", "Queue name & count required.", False),
    (b"confirm q x", "Error parsing count.", False),
    # Kestrel reads its lines as ISO-8859-1: the UTF-8 of other scripts' digits is never digits to its
    # parseInt, as int() would read it. Nor are two signs, a sign alone, `_` or a sign after a digit.
    (b"confirm q \xd9\xa3", "Error parsing count.", False),
    (b"confirm q +\xef\xbc\x95", "Error parsing count.", False),
    (b"get q ++5", "Error parsing timeout.", False),
    (b"get q +-5", "Error parsing timeout.", False),
    (b"get q -+5", "Error parsing timeout.", False),
    (b"put q +:", "Error parsing expiration time.", True),
    (b"monitor q 10 +", "Error parsing max items.", False),
    (b"get q 1_0", "Error parsing timeout.", False),
    (b"get q 5+", "Error parsing timeout.", False),
    (b"get q 01000000000000000000", "Error parsing timeout.", False),  # 19 significant digits
    (b"get q +01000000000000000000", "Error parsing timeout.", False),
    (b"flush", "Queue name required.", False),
    (b"dance", "Unknown command: dance", False),
    (b"", "Unknown command: ", False),  # Kestrel answers every line: a blank one reads as the empty command
    (b"  ", "Unknown command: ", False),
    (b"\xff", "command line is not valid UTF-8", False),
])
def test_bad_lines_name_what_was_wrong(line: bytes, message: str, opens_block: bool) -> None:
    with pytest.raises(TextError) as refused:
        parse_line(line)
    assert refused.value.message == message and refused.value.opens_block == opens_block


@given(st.binary(max_size=120))
def test_every_line_parses_or_is_refused(line: bytes) -> None:
    try:
        command = parse_line(line)
    except TextError as e:
        assert e.message
        words = line.split()
        put_line = bool(words) and words[0].lower() == b"put"
        assert e.opens_block == (put_line or line.rstrip().endswith(b":"))
    else:
        assert command.name
