"""A config file with several mistakes reports them all at once; one mistake reads as it always did."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kestrel.service.config import (
    MAX_CONNECTIONS,
    ConfigErrors,
    ServerConfig,
    each_error,
    from_mapping,
    load,
    with_overrides,
)
from kestrel.storage.config import MAX_DURATION_MS
from kestrel.storage.errors import ConfigError
from tests.conftest import PACKAGE_ROOT


def test_one_bad_key_is_a_plain_config_error_with_its_message() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"thrift_port": 70000})
    assert type(err.value) is ConfigError and err.value.key == "thrift_port"
    assert str(err.value) == "thrift_port: expected a port number 0-65535 (0 disables the listener), got 70000"


def test_every_bad_key_is_reported_in_the_file_s_order() -> None:
    with pytest.raises(ConfigErrors) as err:
        from_mapping({
            "thrift_port": 70000,
            "colour": "blue",
            "default_queue": {"max_items": -1, "sync_journal": "often"},
            "queues": {"jobs": {"max_size": "lots", "max_age": "1h"}, "mail": 3},
            "aliases": {"a": {"targets": ["q"]}, "b": {"destination_queues": ["q"]}, "c": {"destination_queues": "q"}},
            "zookeeper": {"hosts": "zk:2181", "session_timeout": 0},
        })
    keys = [e.key for e in each_error(err.value)]
    assert keys == ["thrift_port", "colour", "default_queue.max_items", "default_queue.sync_journal",
                    "queues.jobs.max_size", "queues.mail", "aliases.a.targets", "aliases.a.destination_queues",
                    "aliases.c.destination_queues",
                    "zookeeper.session_timeout"]
    assert isinstance(err.value, ConfigError) and err.value.key == "thrift_port"  # callers of one error still work
    assert "; colour: unknown setting" in str(err.value)


def test_every_bad_setting_of_a_zookeeper_or_alias_block_is_reported() -> None:
    with pytest.raises(ConfigErrors) as err:
        from_mapping({"zookeeper": {"hosts": ["a", "b"], "session_timeout": "abc", "path_prefix": 7, "port": 1},
                      "aliases": {"al": {"destination_queues": "b", "bogus": 1}}})
    assert [e.key for e in each_error(err.value)] == [
        "zookeeper.port", "zookeeper.hosts", "zookeeper.path_prefix", "zookeeper.session_timeout",
        "aliases.al.bogus", "aliases.al.destination_queues"]
    with pytest.raises(ConfigErrors) as err:
        from_mapping({"zookeeper": {"session_timeout": 0}})
    assert [str(e) for e in each_error(err.value)] == [
        'zookeeper.hosts: required: the ZooKeeper ensemble, e.g. "zk1:2181,zk2:2181"',
        "zookeeper.session_timeout: must be more than 0 (a session that ends at once), got 0"]


def test_the_error_queue_is_checked_when_the_file_is_read() -> None:
    with pytest.raises(ConfigError, match="queues.jobs.error_queue: queue 'jobs' cannot be its own error queue"):
        from_mapping({"queues": {"jobs": {"max_errors": 1, "error_queue": "jobs"}}})


def test_command_line_overrides_report_every_bad_value() -> None:
    with pytest.raises(ConfigErrors) as err:
        with_overrides(ServerConfig(), thrift_port=-1, admin_port=70000, queue_path="q")
    assert [e.key for e in each_error(err.value)] == ["--thrift-port", "--admin-port"]


def test_config_check_refuses_every_name_the_server_would_refuse(tmp_path: Path) -> None:
    """Queue and alias names are checked as a request naming them would be, wherever they appear."""
    path = tmp_path / "kestrel.yaml"
    path.write_text(textwrap.dedent("""\
        queues:
          "bad/name": {max_items: 1}
          "x y": {}
          "a+b+c": {}
          jobs: {max_errors: 3, error_queue: "bad/q", expire_to_queue: "~old"}
        default_queue:
          error_queue: "sp ace"
        aliases:
          "al ias": {destination_queues: [jobs, "a/b"]}
        """))
    with pytest.raises(ConfigErrors) as err:
        load(str(path))
    found = {e.key: e.reason for e in each_error(err.value)}
    assert list(found) == ["queues.bad/name", "queues.x y", "queues.a+b+c", "queues.jobs.error_queue",
                           "queues.jobs.expire_to_queue", "default_queue.error_queue", "aliases.al ias",
                           "aliases.al ias.destination_queues"]
    assert "'/'" in found["queues.bad/name"] and "whitespace" in found["queues.x y"]
    assert found["aliases.al ias"].startswith("alias name 'al ias'")
    assert "'a/b'" in found["aliases.al ias.destination_queues"]


def test_a_queue_or_alias_name_yaml_reads_as_other_than_a_string_is_refused_naming_it(tmp_path: Path) -> None:
    """Unquoted, YAML reads `off` as False, `0755` as 493, `1.5` as a float and `yes` and `true` both as
    True: their settings went to queues named 'False', '493'..., and `yes:` and `true:` were one entry.
    Each is refused as the file writes it, saying to quote it: at start, `config check` and reload
    (all read the file through `load`); a quoted name is a name."""
    path = tmp_path / "kestrel.yaml"
    path.write_text(textwrap.dedent("""\
        queues:
          off: {max_items: 1}
          0755: {max_items: 1}
          1.5: {}
          yes: {max_items: 3}
          true: {max_items: 4}
          "no": {max_items: 5}
        aliases:
          on: {destination_queues: ["no"]}
          null: {destination_queues: ["no"]}
        """))
    with pytest.raises(ConfigErrors) as err:
        load(str(path))
    found = {e.key: e.reason for e in each_error(err.value)}
    assert list(found) == ["queues.off", "queues.0755", "queues.1.5", "queues.yes", "queues.true",
                           "aliases.on", "aliases.null"]
    assert found["queues.off"] == ("YAML reads this queue name unquoted as False, not as the name 'off': "
                                   'quote it ("off": ...)')
    assert "as 493" in found["queues.0755"] and '"0755"' in found["queues.0755"]
    assert "as True" in found["queues.yes"] and "as True" in found["queues.true"]
    assert found["aliases.null"].startswith("YAML reads this alias name unquoted as None")
    proc = subprocess.run([sys.executable, "-m", "kestrel", "config", "check", str(path)],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert proc.returncode == 2 and "queues.off: YAML reads this queue name unquoted as False" in proc.stderr
    path.write_text('queues:\n  "off": {max_items: 1}\n  "0755": {}\naliases:\n  "on": {destination_queues: ["off"]}\n')
    config = load(str(path))
    assert config.queues.for_queue("off").max_items == 1 and config.aliases == {"on": ["off"]}
    with pytest.raises(ConfigError, match=r"queues\.False: expected a queue name, got False: in YAML, quote it"):
        from_mapping({"queues": {False: {}}})  # a mapping built in Python: no text to name


def test_a_reload_of_a_queue_name_yaml_reads_as_a_boolean_keeps_the_settings(tmp_path: Path) -> None:
    from kestrel.service.session.server_state import ServerState

    path = tmp_path / "kestrel.yaml"
    path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  'off': {{max_items: 5}}\n")
    server = ServerState(load(str(path)))
    try:
        path.write_text(f"queue_path: {tmp_path / 'q'}\nqueues:\n  off: {{max_items: 7}}\n")
        with pytest.raises(ConfigError, match=r"queues\.off: YAML reads this queue name unquoted as False"):
            server.reload()
        assert server.collection.configs.for_queue("off").max_items == 5
        assert server.collection.configs.for_queue("False") is server.collection.configs.default
    finally:
        server.close()


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text("thrift_port: 1\nqueues:\n  jobs:\n    max_items: 1\n    max_items: 2\nthrift_port: 2\n"
                    "memcache_port: 70000\n")
    with pytest.raises(ConfigErrors) as err:
        load(str(path))
    assert [str(e) for e in each_error(err.value)] == [
        "queues.jobs.max_items: given twice, on lines 4 and 5; keep one",
        "thrift_port: given twice, on lines 1 and 6; keep one",
        "memcache_port: expected a port number 0-65535 (0 disables the listener), got 70000"]


@pytest.mark.parametrize("setting, valid", [
    ("default_queue: {sync_journal: sometimes}", "always, never or a duration"),
    ("default_queue: {journal_format: kestrel4}", "kestrel2, kestrel3"),
    ("thrift_transport: http", "framed, buffered"),
    ("thrift_protocol: json", "binary, compact"),
    ("default_status: down", "up, readonly or quiescent"),
    ("commit_log: maybe", "on or off"),
    ("salvage: maybe", "true or false"),
])
def test_a_choice_refused_lists_the_valid_values(tmp_path: Path, setting: str, valid: str) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text(setting + "\n")
    with pytest.raises(ConfigError, match=re.escape(valid)):
        load(str(path))


@pytest.mark.parametrize("text", ["queues:\n  a: [\n", "a: b: c\n", "\tqueues: 1\n", "x: 'open\n"])
def test_bad_yaml_is_one_line_with_where(tmp_path: Path, text: str) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(str(path))
    message = str(err.value)
    assert "\n" not in message and re.search(r"not valid YAML: line \d+, column \d+: ", message), message


def _alias_levels(levels: int) -> str:
    """A YAML file whose aliases nest `levels` deep, nine references each: 9**levels values."""
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    return "\n".join(lines) + f"\ndefault_queue: *l{levels - 1}\n"


@pytest.mark.parametrize("text, reason", [
    # 400 bytes: a check of its values (their repr in the error among them) ran for minutes, and a
    # reload of it held the running server as long
    (_alias_levels(9), re.escape("YAML aliases (*name) expand to more than 100,000 values")),
    # 1 MB written once and named 20 times: the values are few, their text 20 MB (99,990 times took
    # a running server's memory past 2.7 GB on a reload, quoting it in the error)
    ("s: &s " + "x" * (1 << 20) + "\nthrift_port: [" + ", ".join(["*s"] * 20) + "]\n",
     re.escape("or 16,777,216 bytes beyond what it writes")),
    ("a: &a {b: *a}\n", re.escape("a YAML alias (*name) within itself")),
    ("x: " + "[" * 5_000 + "]" * 5_000 + "\n", "nested too deeply|exceeded maximum nesting depth"),
    # a list of 600,000 numbers, 1.8 MB: composing it took a gigabyte (4 MB: 15 s)
    ("thrift_port: [" + "1, " * 600_000 + "]\n", re.escape("writes more than 500,000 values: not a config file")),
])
def test_a_file_too_large_once_read_is_refused_at_once(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=reason):
        load(str(path))


def test_a_large_config_without_aliases_is_no_alias_bomb(tmp_path: Path) -> None:
    """9,000 queues of five settings each are 100,000 values: the bound on what aliases expand to
    counted every value, and refused it as an alias bomb."""
    path = tmp_path / "kestrel.yaml"
    path.write_text("queues:\n" + "".join(
        f"  q{n}: {{max_items: 10, max_size: 1MB, max_age: 1h, sync_journal: never, keep_journal: true}}\n"
        for n in range(9_000)))
    assert len(load(str(path)).queues.configured_names()) == 9_000


@pytest.mark.parametrize("text, error", [
    # Python reads no integer of more than 4,300 digits: a traceback naming no key, exit 1
    ("queues:\n  q:\n    max_items: " + "9" * 10_000 + "\n",
     "queues.q.max_items: a number of 10,000 digits: no setting takes one"),
    # a NUL passed the check and failed the start (os.makedirs, the listener's bind)
    ("queue_path: \"/tmp/a\\0b\"\n",
     "queue_path: expected a non-empty string without control characters, got '/tmp/a\\x00b'"),
    ("status_file: \"/tmp/a\\0b\"\n", "status_file: expected a non-empty string without control characters"),
    ("listen_address: \"127.0.0.1\\0\"\n", "listen_address: expected a non-empty string without control"),
    ("zookeeper: {hosts: \"a\\0b:2181\"}\n", "zookeeper.hosts: expected the ZooKeeper ensemble"),
    ("zookeeper: {hosts: \"a:2181\", advertise_host: \"a\\0b\"}\n", "zookeeper.advertise_host: expected a non-empty"),
    # a key with a newline forged a line of its own in the error; a value quoted whole made a huge one
    ("queues:\n  \"q\\nfake.yaml: ok\": {}\n", "'queues.q\\nfake.yaml: ok': queue name"),
    ("thrift_port: " + "x" * 100_000 + "\n", "thrift_port: expected a port number 0-65535"),
])
def test_a_value_no_setting_takes_is_refused_naming_its_key_on_one_short_line(
        tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "kestrel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(str(path))
    message = str(err.value)
    assert message.startswith(error) and "\n" not in message and len(message) < 1_200, message


@pytest.mark.parametrize("key, value, why", [
    ("max_connections", 0, "no connection would be served"),
    ("request_timeout", 0, "every request would time out at once"),
    ("request_timeout", "0ms", "every request would time out at once"),
    ("max_frame_size", "0KB", "no frame or item would fit"),
    ("max_line_length", 0, "no command line would fit"),
    ("max_batch_items", 0, "no put could hold an item"),
    ("max_batch_bytes", 0, "no put could hold an item"),
    ("max_open_reads", 0, "no Thrift get with auto_abort_msec or memcache monitor could open a read"),
    ("max_queues", 0, "no queue could be created"),
])
def test_a_setting_that_would_leave_the_server_serving_nothing_is_refused_at_0(key: str, value: Any,
                                                                                why: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: must be more than 0 \\({why}\\), got {value!r}$"):
        from_mapping({key: value})


LONGEST = MAX_DURATION_MS
LARGEST = 2**63 - 1


@pytest.mark.parametrize(("key", "at_most", "read_as", "over"), [
    ("max_frame_size", LARGEST, LARGEST, LARGEST + 1),
    ("max_batch_items", LARGEST, LARGEST, LARGEST + 1),
    ("max_batch_bytes", f"{LARGEST}b", LARGEST, f"{LARGEST + 1}b"),
    ("max_line_length", LARGEST, LARGEST, 2**70),
    ("max_memory_total", LARGEST, LARGEST, 2**70),
    ("max_open_reads", LARGEST, LARGEST, LARGEST + 1),
    ("max_connections", MAX_CONNECTIONS, MAX_CONNECTIONS, MAX_CONNECTIONS + 1),
    ("tcp_keepalive", "32767s", 32_767_000, "32768s"),
    ("max_wait", f"{LONGEST}ms", LONGEST, f"{LONGEST + 1}ms"),
    ("default_queue.max_items", LARGEST, LARGEST, LARGEST + 1),
    ("default_queue.max_size", LARGEST, LARGEST, "8388608 TB"),
    ("default_queue.max_size", f"{LARGEST}b", LARGEST, "9" * 400 + "MB"),
    ("default_queue.max_age", f"{LONGEST}ms", LONGEST, "9" * 30 + " days"),
])
def test_every_limit_is_refused_by_name_past_what_holds_it(key: str, at_most: Any, read_as: int,
                                                          over: Any) -> None:
    """A count, size or duration the server could not hold (a put's journal record, the C readers'
    limits, gevent's pool, the kernel's keepalive) is refused with the file, where it was accepted and
    then failed every put or connection, or stopped the start with a traceback. At the bound it is
    read exactly (no float rounds `9223372036854775807b` up)."""
    outer, _, inner = key.partition(".")

    def config(value: Any) -> ServerConfig:
        return from_mapping({outer: {inner: value}} if inner else {outer: value})

    settings = config(at_most)
    assert (getattr(settings.queues.default, inner) if inner else getattr(settings, outer)) == read_as
    with pytest.raises(ConfigError) as err:
        config(over)
    assert type(err.value) is ConfigError and err.value.key == key
    assert err.value.reason.startswith("at most "), err.value.reason


def test_two_listeners_on_one_port_are_refused_before_the_start() -> None:
    """Found by `--check`, where the start would have failed binding the second listener."""
    with pytest.raises(ConfigError) as err:
        from_mapping({"text_port": 2229})
    assert str(err.value) == ("text_port: 2229 is thrift_port too: each listener needs a port of its own "
                              "(0 turns one off)")
    from_mapping({"text_port": 0, "admin_port": 0})  # two listeners off share nothing
    with pytest.raises(ConfigError) as err:
        with_overrides(ServerConfig(), memcache_port=2223)
    assert str(err.value).startswith("admin_port: 2223 is --memcache-port too: ")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
    checked = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--check", "--admin-port", "22133"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert checked.returncode == 2 and "--admin-port: 22133 is memcache_port too" in checked.stderr, checked


def test_a_port_used_twice_is_listed_with_the_other_bad_keys() -> None:
    """It was told only once every other key was mended: a second round of errors."""
    with pytest.raises(ConfigErrors) as err:
        from_mapping({"text_port": 22133, "max_wait": "soon", "thrift_port": "x"})
    assert sorted(e.key for e in err.value.errors) == ["max_wait", "text_port", "thrift_port"]
    with pytest.raises(ConfigErrors) as err:  # a bad queue port does not count as turned off
        from_mapping({"zookeeper": {"hosts": "127.0.0.1:2181"}, "memcache_port": "x", "thrift_port": 0,
                      "text_port": 0, "max_wait": "soon"})
    assert sorted(e.key for e in err.value.errors) == ["max_wait", "memcache_port"]


def test_an_alias_must_write_somewhere_and_not_share_a_queue_s_name() -> None:
    """An alias with no queues answered each put as stored and kept nothing; one named like a
    configured queue left that queue's settings to a name no put reaches."""
    with pytest.raises(ConfigErrors) as err:
        from_mapping({"queues": {"jobs": {"max_items": 5}},
                      "aliases": {"nowhere": {"destination_queues": []}, "jobs": {"destination_queues": ["a"]}}})
    assert [str(e) for e in each_error(err.value)] == [
        "aliases.nowhere.destination_queues: expected at least one queue: an alias with none would answer "
        "each put as stored and keep nothing",
        "aliases.jobs: 'jobs' is configured under queues too: a name is an alias or a queue, not both"]
