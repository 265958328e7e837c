"""The memcache parser without sockets: what a refused set does with the item data that follows."""

from __future__ import annotations

import pytest

from kestrel.service.memcache.commands import ProtocolError, parse_line


def test_a_bad_value_is_not_echoed_whole() -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_line(b"confirm q " + b"9x" * 30_000)
    assert refused.value.reply.startswith("CLIENT_ERROR bad count '9x9x")
    assert len(refused.value.reply) == len("CLIENT_ERROR ") + 512 and refused.value.reply.endswith("...")


@pytest.mark.parametrize("line, skip, close", [
    (b"set q 0 0 abc", 0, True),  # the length is unreadable: the connection must close
    (b"set q 0 0", 0, True),
    (b"set q 0 0 99999999999", 0, True),
    (b"set q x 0 5", 7, False),  # the length is known: its data and CRLF are skipped
    (b"set q 0 9223372036854776 1", 3, False),
    (b"set q 0 0 5 loudly", 0, True),  # an argument too many: which one is the length is unknown
    (b"set my queue 0 0 5", 0, True),  # (taken as the 4th, 2 bytes of 5 would be skipped)
    (b"set jobs\xff 0 0 13", 15, False),  # not UTF-8 anywhere on the line: refused, its data skipped
    (b"set jobs 0 0 5 \xc0\x80", 0, True),  # (an overlong encoding: an argument too many)
    (b"set jobs\xed\xa0\x80 0 0 2 noreply", 4, False),  # (a surrogate)
    (b"SET jobs \xff 0 3", 5, False),
    (b"set q x 0 +5", 7, False),  # a `+` length is read as Kestrel's parseInt reads it
    (b"set q 0 0 ++5", 0, True),
    (b"set q 0 0 -0", 0, True),  # a length takes no `-` (parseInt would read 0)
])
def test_refused_set_says_what_to_do_with_its_data(line: bytes, skip: int, close: bool) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_line(line)
    assert refused.value.reply.startswith("CLIENT_ERROR ")
    assert (refused.value.skip, refused.value.close) == (skip, close)


@pytest.mark.parametrize("line, name, noreply", [
    (b"flush_all noreply", "flush_all", True),
    (b"flush_all 0 noreply", "flush_all", True),
    (b"flush_all 0", "flush_all", False),
    (b"flush_all +0 noreply", "flush_all", True),
    (b"delete q 0 noreply", "delete", True),
    (b"flush_expired q noreply", "flush_expired", True),
    (b"flush_all_expired", "flush_all_expired", False),
])
def test_noreply_forms(line: bytes, name: str, noreply: bool) -> None:
    command = parse_line(line)
    assert (command.name, command.noreply) == (name, noreply)


def test_arguments_are_split_at_spaces_alone() -> None:
    # Python's other whitespace is part of a key (then refused as a queue name), never a separator.
    assert parse_line("get n\x85m".encode()).key == "n\x85m"
    assert parse_line(b"get  q   other").key == "q"


def test_gets_and_multi_key_get() -> None:
    assert parse_line(b"gets q").cas and not parse_line(b"get q").cas
    command = parse_line(b"get a b c")
    assert command.key == "a" and command.get is not None and command.get.queue == "a"


@pytest.mark.parametrize("period, ms", [(b"1", 1000), (b"0.25", 250), (b".5", 500), (b"0", 0)])
def test_monitor_periods(period: bytes, ms: int) -> None:
    assert parse_line(b"monitor q " + period).timeout_ms == ms


def test_empty_and_unknown_lines_are_client_errors() -> None:
    """An unknown command closes the connection, as Kestrel's does: what follows it may be its data
    (memcached's meta `ms`, a misspelt or tab-separated storage command, a name not UTF-8)."""
    with pytest.raises(ProtocolError) as refused:
        parse_line(b"")
    assert (refused.value.reply, refused.value.close) == ("CLIENT_ERROR empty command line", False)
    for line, name in ((b"bogus", "bogus"), (b"ms jobs 9 T0", "ms"), (b"set\tjobs 0 0 9", "set\tjobs"),
                       (b"g\xffet q", "g\ufffdet")):
        with pytest.raises(ProtocolError) as refused:
            parse_line(line)
        assert refused.value.reply.startswith(f"CLIENT_ERROR unknown command {name!r} (closing") and \
            refused.value.close, line


def test_a_lone_noreply_is_a_queue_name() -> None:
    """`delete noreply` deletes the queue `noreply`, as memcached reads it; `dump_stats` has no
    reply to leave out, so each word is a queue's name."""
    for verb in ("delete", "flush", "flush_expired"):
        assert (parse_line(f"{verb} noreply".encode()).key, parse_line(f"{verb} noreply".encode()).noreply) \
            == ("noreply", False)
        assert parse_line(f"{verb} q noreply".encode()).noreply
    assert parse_line(b"dump_stats noreply").keys == ("noreply",)


def test_only_short_lines_are_remembered() -> None:
    """A client chooses its lines: 4,096 distinct long ones remembered would hold their bytes and
    their Commands for good (a `dump_stats` of thousands of names)."""
    from kestrel.service.memcache import commands

    long_line = b"dump_stats " + b" ".join(b"q%d" % n for n in range(commands.CACHED_LINE_BYTES))
    before = commands._parse_remembered.cache_info().currsize
    assert len(parse_line(long_line).keys) == commands.CACHED_LINE_BYTES
    assert commands._parse_remembered.cache_info().currsize == before
    short = b"get remembered-%d" % before
    assert parse_line(short) is parse_line(short)


@pytest.mark.parametrize("line, skip, close", [
    (b"add q 0 0 10", 12, False),  # each storage verb's data block is skipped, never run as a command
    (b"replace q 0 0 3 noreply", 5, False),
    (b"append q 0 0 0", 2, False),
    (b"prepend q 0 0 7", 9, False),
    (b"cas q 0 0 10 12345", 12, False),
    (b"add q 0 0 abc", 0, True),  # its length unreadable: the connection closes
    (b"cas q", 0, True),
    (b"add my queue 0 0 5", 0, True),  # each verb's own arguments, or the length is unknown
    (b"cas q 0 0 10", 0, True),
    (b"cas q 0 0 10 1 2", 0, True),
])
def test_unsupported_storage_commands_drop_their_data(line: bytes, skip: int, close: bool) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_line(line)
    verb = line.split()[0].decode()
    assert refused.value.reply.startswith(f"CLIENT_ERROR {verb} is not supported")
    assert (refused.value.skip, refused.value.close) == (skip, close)


@pytest.mark.parametrize("line, skip, close", [
    (b"add q\xff 0 0 10", 12, False),
    (b"cas q 0 0 10 1\xfe", 12, False),
    (b"cas q\xff 0 0 10", 0, True),
    (b"delete q\xff", 0, False),  # not a storage command: no data follows
])
def test_a_line_that_is_not_utf8_is_refused_and_its_data_never_read_as_commands(line: bytes, skip: int,
                                                                               close: bool) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_line(line)
    assert refused.value.reply.startswith("CLIENT_ERROR command line is not valid UTF-8")
    assert (refused.value.skip, refused.value.close) == (skip, close)


@pytest.mark.parametrize("line, name", [
    (b"version foo bar", "version"),  # what follows is ignored, as Kestrel and memcached do
    (b"stats cachedump 0 0", "stats"),  # libmemcached's memcdump
    (b"stats items", "stats"),
    (b"reload now", "reload"),
])
def test_arguments_kestrel_ignores_are_ignored(line: bytes, name: str) -> None:
    assert parse_line(line).name == name


@pytest.mark.parametrize("line, field, value", [
    (b"set q 0 0 00000000001", "size", 1),  # as memcached's strtoul and Kestrel's parseInt read it
    (b"set q 000000000000000000000 -000000000000000000005 0", "expiry", -5),
    (b"get q/t=000000000025", "get", 25),
    (b"monitor q 00000000002.5", "timeout_ms", 2500),
    (b"confirm q 0000000000000000000000003", "count", 3),
])
def test_a_number_is_judged_by_its_value_not_its_leading_zeros(line: bytes, field: str, value: int) -> None:
    command = parse_line(line)
    got = getattr(command, field)
    assert (got.timeout_ms if field == "get" else got) == value


@pytest.mark.parametrize("line, field, value", [
    (b"set q +0 +0 +5", "size", 5),  # naggati reads <bytes> with toInt, Kestrel the rest
    (b"set q +4294967295 +60 1", "expiry", 60),
    (b"get q/t=+25", "get", 25),
    (b"get q/open/t=+0000000000025", "get", 25),
    (b"monitor q +2.5", "timeout_ms", 2500),
    (b"monitor q +2 +3", "count", 3),
    (b"confirm q +3", "count", 3),
])
def test_a_number_may_have_a_plus_first_as_kestrels_parse_int_takes_it(line: bytes, field: str,
                                                                        value: int) -> None:
    command = parse_line(line)
    got = getattr(command, field)
    assert (got.timeout_ms if field == "get" else got) == value


@pytest.mark.parametrize("line, reply", [
    (b"set q 0 0 \xd9\xa1", "CLIENT_ERROR bad byte count '\u0661': expected 0..2147483647 (closing: the item's length is unknown)"),
    (b"set q ++1 0 1", "CLIENT_ERROR bad flags '++1'"),
    (b"set q 0 +-1 1", "CLIENT_ERROR bad exptime '+-1'"),
    (b"set q 0 0 +\xef\xbc\x95", "CLIENT_ERROR bad byte count '+\uff15': expected 0..2147483647 (closing: the "
     "item's length is unknown)"),
    (b"set q 0 0 1_0", "CLIENT_ERROR bad byte count '1_0': expected 0..2147483647 (closing: the item's length is unknown)"),
    (b"get q/t=\xd9\xa3", "CLIENT_ERROR bad timeout 't=\u0663': expected t=<milliseconds>"),
    (b"get q/t=010000000000", "CLIENT_ERROR bad timeout 't=010000000000': expected t=<milliseconds>"),
    (b"get q/t=+", "CLIENT_ERROR bad timeout 't=+': expected t=<milliseconds>"),
    (b"get q/t=-0", "CLIENT_ERROR bad timeout 't=-0': expected t=<milliseconds>"),
    (b"get q/t=+010000000000", "CLIENT_ERROR bad timeout 't=+010000000000': expected t=<milliseconds>"),
    (b"monitor q +.5", "CLIENT_ERROR bad monitor period '+.5': expected seconds, a number 0 or more"),
    (b"monitor q 1.+5", "CLIENT_ERROR bad monitor period '1.+5': expected seconds, a number 0 or more"),
    (b"monitor q -1", "CLIENT_ERROR bad monitor period '-1': expected seconds, a number 0 or more"),
    (b"monitor q 0" + b"9" * 11, "CLIENT_ERROR bad monitor period '0" + "9" * 11
     + "': expected seconds, a number 0 or more"),
    (b"confirm q -", "CLIENT_ERROR bad count '-'"),
    (b"confirm q +", "CLIENT_ERROR bad count '+'"),
    (b"confirm q 3+", "CLIENT_ERROR bad count '3+'"),
    (b"confirm q 0" + b"9" * 21, "CLIENT_ERROR bad count '0" + "9" * 21 + "'"),
])
def test_a_number_is_ascii_digits_within_its_width(line: bytes, reply: str) -> None:
    # Python's int() takes other scripts' digits and `_`, which Kestrel's parseInt never reads as a
    # number (its lines are ISO-8859-1): a number here is a sign and 0-9 alone, and its significant
    # digits are bounded before int() converts them.
    with pytest.raises(ProtocolError) as refused:
        parse_line(line)
    assert refused.value.reply == reply
