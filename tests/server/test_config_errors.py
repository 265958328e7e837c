"""A config file with several mistakes reports them all at once; one mistake reads as it always did."""

from __future__ import annotations

import pytest

from kestrel.service.config import ConfigErrors, ServerConfig, each_error, from_mapping, with_overrides
from kestrel.storage.errors import ConfigError


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
                    "queues.jobs.max_size", "queues.mail", "aliases.a.targets", "aliases.c.destination_queues",
                    "zookeeper.session_timeout"]
    assert isinstance(err.value, ConfigError) and err.value.key == "thrift_port"  # callers of one error still work
    assert "; colour: unknown setting" in str(err.value)


def test_the_error_queue_is_checked_when_the_file_is_read() -> None:
    with pytest.raises(ConfigError, match="queues.jobs.error_queue: queue 'jobs' cannot be its own error queue"):
        from_mapping({"queues": {"jobs": {"max_errors": 1, "error_queue": "jobs"}}})


def test_command_line_overrides_report_every_bad_value() -> None:
    with pytest.raises(ConfigErrors) as err:
        with_overrides(ServerConfig(), thrift_port=-1, admin_port=70000, queue_path="q")
    assert [e.key for e in each_error(err.value)] == ["--thrift-port", "--admin-port"]
