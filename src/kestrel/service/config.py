"""The server's configuration, read from YAML. Every key is checked at start; unknown keys are errors.

A file with several mistakes reports them all at once (ConfigErrors, one entry per key), so that an
operator fixes the file in one pass instead of one restart per mistake.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kestrel.contract import server_sets
from kestrel.service.session.status import Status, UnknownStatus
from kestrel.storage import disk, layout
from kestrel.storage.config import (
    QueueConfig,
    QueueConfigs,
    check_across_queues,
    parse_bool,
    parse_count,
    parse_duration_ms,
    parse_optional_duration_ms,
    parse_size,
)
from kestrel.storage.errors import ConfigError, InvalidQueueName
from kestrel.storage.filenames import check_queue_name

# The example configuration, every key with a comment, shipped in the package (`kestrel config example`).
EXAMPLE = Path(__file__).with_name("kestrel.yaml")


class ConfigErrors(ConfigError):
    """Several settings are wrong: `errors` holds one ConfigError per key, in the file's order.

    It is a ConfigError naming the first key, so that callers catching one error need not change.
    """

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(errors[0].key, errors[0].reason)
        self.errors = errors
        self.args = ("; ".join(str(e) for e in errors),)

    def __str__(self) -> str:
        return str(self.args[0])


def each_error(error: ConfigError) -> list[ConfigError]:
    """The single errors a ConfigError stands for: itself, or each of a ConfigErrors."""
    return list(error.errors) if isinstance(error, ConfigErrors) else [error]


class _Collector:
    """Runs each check, keeps every ConfigError it raises, and raises them together at the end."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def check(self, parse: Any, *args: Any) -> Any:
        try:
            return parse(*args)
        except ConfigError as e:
            self.errors.extend(each_error(e))
            return None

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


def _port(key: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
        return value
    raise ConfigError(key, f"expected a port number 0-65535 (0 disables the listener), got {value!r}")


def _string(key: str, value: Any) -> str:
    """A path, an address, a host: no NUL (which no file or host name holds: the start failed on it
    after the check passed the file) and no other control character."""
    if isinstance(value, str) and value and value.isprintable():
        return value
    raise ConfigError(key, f"expected a non-empty string without control characters, got {value!r}")


def _optional_path(key: str, value: Any) -> str | None:
    return None if value is None else _string(key, value)


def _choice(*choices: str) -> Any:
    def parse(key: str, value: Any) -> str:
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")
    return parse


def _on_off(key: str, value: Any) -> bool:
    """`on` or `off` (YAML reads both unquoted as booleans; quoted, they are strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off"):
        return value.lower() == "on"
    raise ConfigError(key, f"expected on or off, got {value!r}")


def _status(key: str, value: Any) -> Status:
    if isinstance(value, str):
        try:
            return Status.parse(value)
        except UnknownStatus:
            pass
    raise ConfigError(key, f"expected up, readonly or quiescent, got {value!r}")


@dataclass(frozen=True)
class ZooKeeperConfig:
    """Where the server advertises itself: the ZooKeeper ensemble and the server sets' parent path."""

    hosts: str
    path_prefix: str = "/kestrel"
    session_timeout: int = 10_000  # ms
    advertise_host: str | None = None  # None: listen_address, or this host's name when that is 0.0.0.0


def _zookeeper(key: str, value: Any) -> ZooKeeperConfig | None:
    """The `zookeeper` block; every bad setting of it reported at once."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping with hosts, path_prefix, session_timeout, "
                               f"advertise_host; got {value!r}")
    known = ("hosts", "path_prefix", "session_timeout", "advertise_host")
    collect = _Collector()
    collect.errors += [ConfigError(f"{key}.{name}", f"unknown zookeeper setting (known: {', '.join(known)})")
                       for name in sorted(set(value) - set(known), key=str)]
    hosts = collect.check(_zookeeper_hosts, f"{key}.hosts", value.get("hosts"))
    prefix = collect.check(_zookeeper_path, f"{key}.path_prefix", value.get("path_prefix", "/kestrel"))
    timeout = collect.check(_more_than_zero(parse_duration_ms, "a session that ends at once"),
                            f"{key}.session_timeout", value.get("session_timeout", "10s"))
    advertise = value.get("advertise_host")
    if advertise is not None:
        advertise = collect.check(_string, f"{key}.advertise_host", advertise)
    collect.raise_any()
    return ZooKeeperConfig(hosts=hosts, path_prefix=prefix, session_timeout=timeout, advertise_host=advertise)


def _zookeeper_hosts(key: str, value: Any) -> str:
    if value is None:
        raise ConfigError(key, "required: the ZooKeeper ensemble, e.g. \"zk1:2181,zk2:2181\"")
    try:
        return server_sets.checked_hosts(value)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None


def _zookeeper_path(key: str, value: Any) -> str:
    try:
        return server_sets.checked_path(value)
    except ValueError as e:
        raise ConfigError(key, str(e)) from None


def default_memory_total(proc_root: str = "/proc", sys_root: str = "/sys") -> int:
    """`max_memory_total` when the file sets none: a quarter of the memory the server may use, the
    smallest limit of its cgroup and the cgroup's ancestors (`cgroup_memory_limit`), else the machine's
    memory (`MemTotal`). A quarter, since the budget counts item bytes alone: each item's object, what
    the allocator keeps of freed ones, requests and journal buffers come on top. The roots are where
    /proc and /sys are read (a test's fake trees)."""
    limit = _physical_memory(proc_root)
    cgroup = cgroup_memory_limit(proc_root, sys_root)
    return (limit if cgroup is None else min(limit, cgroup)) // 4


def _physical_memory(proc_root: str) -> int:
    """The machine's memory: `MemTotal` of meminfo, else what sysconf says, else 4 GiB (assume small)."""
    try:
        with open(os.path.join(proc_root, "meminfo")) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30


# cgroup v1 says "no limit" with the largest page counter, a page short of 2**63 (9223372036854771712);
# anything from 2**62 on is no limit a machine could meet.
_V1_NO_LIMIT = 1 << 62


def cgroup_memory_limit(proc_root: str = "/proc", sys_root: str = "/sys") -> int | None:
    """The smallest memory limit the kernel holds this process to, or None: where the kernel kills.

    A limit is set on a cgroup, and binds every cgroup beneath it, so each cgroup from the process's
    own (named in /proc/self/cgroup: v2 `0::/path`, v1 the line of the `memory` controller) up to the
    hierarchy's root is read: v2 `memory.max` ("max": none), v1 `memory.limit_in_bytes` (a huge value:
    none). Reading the root alone missed systemd's `MemoryMax=`, set on the service's own cgroup. A
    cgroup namespace or a container's mount shows its own cgroup as the root: read too, and a path
    that is not under the mount (a missing directory) is skipped."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v2_path = v1_path = "/"
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    root = os.path.join(sys_root, "fs", "cgroup")
    limits = [*_limits_up_to_root(root, "memory.max", v2_path),
              *_limits_up_to_root(os.path.join(root, "memory"), "memory.limit_in_bytes", v1_path)]
    return min(limits, default=None)


def _limits_up_to_root(base: str, name: str, path: str) -> list[int]:
    """The limits set in file `name` of cgroup `path` (under the mount at `base`) and its ancestors."""
    parts = [part for part in path.strip().split("/") if part]
    if ".." in parts:  # a cgroup outside this namespace's root: only the root is ours to read
        parts = []
    limits = []
    for depth in range(len(parts), -1, -1):
        try:
            with open(os.path.join(base, *parts[:depth], name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _V1_NO_LIMIT:  # v2 says "max" when there is none
            limits.append(int(text))
    return limits


@dataclass
class ServerConfig:
    """Server settings with their defaults; queue settings live in `queues`, parsed at load."""

    queue_path: str = "./var/spool/kestrel"
    listen_address: str = "127.0.0.1"
    thrift_port: int = 2229
    memcache_port: int = 22133
    text_port: int = 2222
    admin_port: int = 2223
    expiration_timer_frequency: int = 1000  # ms; 0 turns the background sweep off
    max_open_reads: int = 100
    default_status: Status = Status.UP
    # In the server's own directory, out of the scan by which Kestrel finds journals (layout.py).
    status_file: str | None = "{queue_path}/.kestrel/status"
    status_change_grace_period: int = 0  # ms
    thrift_transport: str = "framed"
    thrift_protocol: str = "binary"
    max_frame_size: int = 16 * 1024 * 1024
    max_line_length: int = 64 * 1024
    max_connections: int = 100_000
    client_timeout: int | None = None  # ms a connection may sit idle between requests; None = forever
    tcp_keepalive: int | None = 60_000  # ms of silence before TCP probes a client's machine; None = off
    request_timeout: int = 30_000  # ms to receive the rest of a request once its first byte arrived
    max_wait: int = 300_000  # ms cap on any blocking read (get/t=, monitor, Thrift timeout_msec)
    max_batch_items: int = 100_000  # items in one put call or text put block
    max_batch_bytes: int = 16 * 1024 * 1024  # item bytes in one put call or text put block
    max_queues: int = 10_000  # queues (fanout children included) one server holds
    # Bytes every queue together may hold in memory (src/kestrel/storage/memory.py; docs/memory.md); 0 = no
    # budget, each queue bounded by its max_memory_size alone.
    max_memory_total: int = field(default_factory=default_memory_total)
    shutdown_timeout: int = 5000  # ms that calls in flight get to answer on shutdown
    salvage: bool = False
    # Queues under sync_journal: always or a periodic sync, in either format, wait for one server-wide
    # log's fsync, not their journals' (src/kestrel/storage/commit_log.py; docs/durability.md).
    commit_log: bool = True
    zookeeper: ZooKeeperConfig | None = None  # None: join no server sets
    queues: QueueConfigs = field(default_factory=QueueConfigs)  # `default_queue` and `queues`, parsed
    aliases: dict[str, list[str]] = field(default_factory=dict)
    source: str | None = None  # the file this came from, for reloads
    # The top-level keys the file set: a reload of a file that sets none, while these are some, is
    # refused (`check_reload`).
    file_keys: tuple[str, ...] = ()
    overridden: tuple[str, ...] = ()  # the keys the command line set, which a reload leaves alone

    def resolved_status_file(self) -> str | None:
        """The status file's path; the earlier default, beside the journals, is where the owner of the
        queue path moved it (`layout.migrate`)."""
        if self.status_file is None:
            return None
        return layout.current_path(self.queue_path, self.status_file.replace("{queue_path}", self.queue_path))


def _memory_total(key: str, value: Any) -> int:
    """A size, 0 (no budget) or `auto` (`default_memory_total`, what an unset key gives)."""
    if value == "auto":
        return default_memory_total()
    return parse_size(key, value, expected="a size such as 2GB, 0 (no budget) or auto")


# Listener limits the system sets: gevent's pool counts connections in a C int; Linux takes a TCP
# keepalive idle time of at most 32767 s (the listener's socket option is refused past it).
MAX_CONNECTIONS = 2**31 - 1
MAX_KEEPALIVE_MS = 32_767_000


def _more_than_zero(parse: Callable[[str, Any], int], why: str) -> Callable[[str, Any], int]:
    """`parse`, refusing 0 for a setting where 0 leaves the server serving nothing (`why`)."""
    def parse_more_than_zero(key: str, value: Any) -> int:
        parsed = parse(key, value)
        if parsed == 0:
            raise ConfigError(key, f"must be more than 0 ({why}), got {value!r}")
        return parsed
    return parse_more_than_zero


_PARSERS: dict[str, Any] = {
    "queue_path": _string,
    "listen_address": _string,
    "thrift_port": _port,
    "memcache_port": _port,
    "text_port": _port,
    "admin_port": _port,
    "expiration_timer_frequency": parse_duration_ms,
    "max_open_reads": _more_than_zero(parse_count, "no Thrift get with auto_abort_msec or memcache "
                                                   "monitor could open a read"),
    "default_status": _status,
    "status_file": _optional_path,
    "status_change_grace_period": parse_duration_ms,
    "thrift_transport": _choice("framed", "buffered"),
    "thrift_protocol": _choice("binary", "compact"),
    "max_frame_size": _more_than_zero(parse_size, "no frame or item would fit"),
    "max_line_length": _more_than_zero(parse_size, "no command line would fit"),
    "max_connections": _more_than_zero(functools.partial(parse_count, most=MAX_CONNECTIONS),
                                       "no connection would be served"),
    "client_timeout": parse_optional_duration_ms,
    "tcp_keepalive": functools.partial(parse_optional_duration_ms, most=MAX_KEEPALIVE_MS),
    "request_timeout": _more_than_zero(parse_duration_ms, "every request would time out at once"),
    "max_wait": parse_duration_ms,
    "max_batch_items": _more_than_zero(parse_count, "no put could hold an item"),
    "max_batch_bytes": _more_than_zero(parse_size, "no put could hold an item"),
    "max_queues": _more_than_zero(parse_count, "no queue could be created"),
    "max_memory_total": _memory_total,
    "shutdown_timeout": parse_duration_ms,
    "salvage": parse_bool,
    "commit_log": _on_off,
    "zookeeper": _zookeeper,
}


def _aliases(value: Any, collect: _Collector) -> dict[str, list[str]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError("aliases", f"expected a mapping of alias name to settings, got {value!r}")
    out = {}
    for name, settings in value.items():
        collect.check(_queue_name, f"aliases.{name}", name, "alias")
        dests = collect.check(_alias, f"aliases.{name}", settings)
        if dests is not None:
            out[str(name)] = dests
    for name in out:
        collect.check(_no_alias_cycle, name, out)
    return out


def _no_alias_cycle(name: str, aliases: Mapping[str, list[str]]) -> None:
    """Refuse an alias that reaches itself through the aliases it writes to: each put would go round
    until the interpreter's recursion limit, adding a copy to every queue on the way each time."""
    path, todo = [name], [(name, iter(aliases[name]))]
    while todo:
        _, dests = todo[-1]
        dest = next(dests, None)
        if dest is None:
            todo.pop()
            path.pop()
        elif dest == name:
            raise ConfigError(f"aliases.{name}.destination_queues",
                              f"goes round back to itself: {' -> '.join([*path, name])}")
        elif dest in aliases and dest not in path:
            path.append(dest)
            todo.append((dest, iter(aliases[dest])))


def _alias(key: str, settings: Any) -> list[str]:
    """One alias's settings; every bad one reported at once."""
    if not isinstance(settings, Mapping):
        raise ConfigError(key, f"expected a mapping with destination_queues, got {settings!r}")
    collect = _Collector()
    collect.errors += [ConfigError(f"{key}.{name}", "unknown alias setting (known: destination_queues)")
                       for name in sorted(set(settings) - {"destination_queues"}, key=str)]
    dests = collect.check(_destinations, f"{key}.destination_queues", settings.get("destination_queues"))
    collect.raise_any()
    return list(dests)


def _destinations(key: str, dests: Any) -> list[str]:
    if not isinstance(dests, list) or not all(isinstance(d, str) and d for d in dests):
        raise ConfigError(key, f"expected a list of queue names, got {dests!r}")
    if not dests:
        raise ConfigError(key, "expected at least one queue: an alias with none would answer each put as "
                               "stored and keep nothing")
    for dest in dests:
        _queue_name(key, dest, "queue")
    return dests


def _queue_name(key: str, name: Any, what: str) -> None:
    """Refuse a configured name that a request naming it would be refused for, and one that is not a
    string: YAML reads an unquoted `off`, `yes`, `0755` or `~` as a boolean, a number or null, so
    `off:` configured a queue named 'False' (and `yes:` and `true:` one entry, 'True')."""
    try:
        check_queue_name(str(name))
    except InvalidQueueName as e:
        raise ConfigError(key, str(e).replace("queue name", f"{what} name", 1)) from None
    if isinstance(name, WrittenKey):
        raise ConfigError(key, f"YAML reads this {what} name unquoted as {name.read_as!r}, not as the name "
                               f"{str(name)!r}: quote it ({_quoted(name)}: ...)")
    if not isinstance(name, str):
        raise ConfigError(key, f"expected a {what} name, got {name!r}: in YAML, quote it")


def _queue_settings(key: str, value: Any, collect: _Collector) -> dict[str, Any]:
    """The queue names and their raw settings under `queues`, each setting checked on its own."""
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping of queue name to settings, got {value!r}")
    queues = {}
    for name, settings in (value or {}).items():
        collect.check(_queue_name, f"{key}.{name}", name, "queue")
        queues[str(name)] = settings if settings is not None else {}
        _check_queue_settings(f"{key}.{name}", queues[str(name)], collect)
    return queues


def _check_queue_settings(key: str, settings: Any, collect: _Collector) -> None:
    """Each queue setting parsed alone, so that every bad one is reported, not only the first."""
    if not isinstance(settings, Mapping):
        collect.check(QueueConfig.from_mapping, settings, key)
        return
    for name, value in settings.items():
        collect.check(QueueConfig.from_mapping, {name: value}, key)


def from_mapping(data: Mapping[str, Any] | None, source: str | None = None) -> ServerConfig:
    """A ServerConfig from parsed YAML; raises ConfigError naming the key path (ConfigErrors, naming
    each, when several settings are wrong)."""
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError("(top level)", f"expected a mapping of settings, got {type(data).__name__}")
    collect = _Collector()
    values: dict[str, Any] = {"source": source, "file_keys": tuple(str(key) for key in data)}
    default_queue: Mapping[str, Any] = {}
    queues: dict[str, Any] = {}
    for key, value in data.items():
        if key in _PARSERS:
            values[key] = collect.check(_PARSERS[key], key, value)
        elif key == "default_queue":
            if value is not None and not isinstance(value, Mapping):
                collect.errors.append(ConfigError(
                    key, f"expected a mapping of queue settings, got {value!r}"))
                continue
            default_queue = value or {}
            _check_queue_settings(key, default_queue, collect)
        elif key == "queues":
            queues = collect.check(_queue_settings, key, value, collect) or {}
        elif key == "aliases":
            values[key] = collect.check(_aliases, value, collect)
        else:
            known = ", ".join(sorted([*_PARSERS, "default_queue", "queues", "aliases"]))
            collect.errors.append(ConfigError(str(key), f"unknown setting (known: {known})"))
    for name in sorted(set(values.get("aliases") or ()) & set(queues)):
        collect.errors.append(ConfigError(f"aliases.{name}", f"{name!r} is configured under queues too: "
                                          "a name is an alias or a queue, not both"))
    # listed with the others: a bad key elsewhere kept this one from being told until it was mended
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    collect.check(_check_ports, lambda key: values.get(key, defaults[key]), lambda field: field)
    collect.raise_any()
    # every queue setting parsed once, here; then the settings that name other queues
    values["queues"] = QueueConfigs(default_queue, queues)
    check_across_queues(values["queues"], values.get("aliases") or {})
    return ServerConfig(**values)


def _check_ports(setting: Callable[[str], Any], name_of: Callable[[str], str]) -> None:
    """Refuse two listeners on one port (the second could never bind), and server sets to join with
    no queue listener to advertise in them, both of which `--check` said ok. `setting`: a setting's
    value by name, None where it was refused."""
    taken: dict[int, str] = {}
    for key in (f.name for f in dataclasses.fields(ServerConfig) if f.name.endswith("_port")):
        port = setting(key)
        if port and port in taken:
            raise ConfigError(name_of(key), f"{port} is {name_of(taken[port])} too: each listener "
                              "needs a port of its own (0 turns one off)")
        taken[port] = key
    queue_ports = [setting(key) for key in ("memcache_port", "thrift_port", "text_port")]
    if setting("zookeeper") is not None and not any(queue_ports) and None not in queue_ports:
        raise ConfigError("zookeeper", f"no queue listener to advertise in the server sets: "
                          f"{name_of('memcache_port')}, {name_of('thrift_port')} and "
                          f"{name_of('text_port')} are all 0 (turn one on, or remove the zookeeper block)")


def load(path: str | None) -> ServerConfig:
    """Read a YAML file (None: the built-in defaults)."""
    if path is None:
        return ServerConfig()
    try:
        text = _read_config_text(path)
        _check_values(path, text)
        loader = _ConfigLoader(text)
        try:
            composed = loader.get_single_node()
            _check_expansion(path, composed)
            found = _node_errors(composed)
            if any(e.fatal for e in found):  # what YAML cannot build: refused before it tries
                raise ConfigErrors(list(found))
            data = loader.construct_document(composed) if composed is not None else None
        finally:
            loader.dispose()
    except OSError as e:
        raise ConfigError(path, f"cannot read the config file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, f"not UTF-8 text: {e.reason} at byte {e.start}") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, f"not valid YAML: {_one_line(e)}") from None
    except RecursionError:
        raise ConfigError(path, "nested too deeply, or a YAML alias (*name) within itself: not a config "
                                "file") from None
    errors: list[ConfigError] = list(found)
    try:
        config = from_mapping(data, os.path.abspath(path))
    except ConfigError as e:
        errors.extend(each_error(e))
    collect = _Collector()
    collect.errors = errors
    collect.raise_any()
    return config


class WrittenKey(str):
    """A mapping key that YAML reads as other than a string (an unquoted `off`, `yes`, `0755`, `~`),
    kept as the file writes it, with what YAML reads it as (`read_as`): so that a queue or alias
    name is refused naming what the file says (`_queue_name`), and `yes:` and `true:` stay two keys."""

    read_as: Any

    def __new__(cls, written: str, read_as: Any) -> WrittenKey:
        key = super().__new__(cls, written)
        key.read_as = read_as
        return key


class _ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """PyYAML's safe loader (builds no objects but plain data; libyaml's parser where PyYAML has it:
    a megabyte of YAML took seconds in Python's), but each mapping key YAML reads as other than a
    string is a WrittenKey."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        self.flatten_mapping(node)  # `<<: *other` merges, as the safe loader does
        mapping: dict[Hashable, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key_node, yaml.ScalarNode) and not isinstance(key, str):
                key = WrittenKey(key_node.value, key)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        "found unhashable key", key_node.start_mark)
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping


def _quoted(name: str) -> str:
    """`name` as a YAML string: in double quotes, as JSON writes it (a YAML double-quoted string)."""
    return json.dumps(name)


def check_reload(running: ServerConfig, fresh: ServerConfig) -> None:
    """Refuse a reload of a file that sets nothing (empty, only comments) while the running config
    was read from one that set something: an emptied or truncated file (an editor's crash, a full
    disk) read as one asking for the defaults reset every queue's settings (`sync_journal: always`
    became `never`), with only a warning about the server's own keys. Raises ConfigError."""
    if not fresh.file_keys and running.file_keys:
        raise ConfigError(fresh.source or "(config)",
                          "holds no settings (empty, or only comments), while the running config sets "
                          f"{', '.join(running.file_keys)}: an emptied or cut off file? To reset every "
                          "queue's settings on purpose, reload a file with `queues: {}`")


def _one_line(error: yaml.YAMLError) -> str:
    """PyYAML's error, which spans several lines, as one: where, what, and while doing what."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())
    mark = error.problem_mark or error.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = f" ({error.context})" if error.context else ""
    return f"{where}{error.problem}{context}"


# What a config file's aliases may add once expanded, in values and in bytes of text: nine levels of
# aliases in 400 bytes are a billion values, and a megabyte written once and named 100,000 times is
# 100 GB; each check of a value (its repr in an error among them) would walk them all.
MAX_EXPANDED_VALUES = 100_000
MAX_EXPANDED_BYTES = 16 << 20
# The longest number a config value may be: Python reads no longer one as an integer.
MAX_NUMBER_DIGITS = 4_000
# A config file is read whole, before anything of it is parsed: no config comes near this size.
MAX_CONFIG_BYTES = 16 << 20
# What a config file may write, as YAML reads it (each scalar, and each mapping and sequence's start
# and end): 10,000 queues of 20 settings each are 420,000.
MAX_CONFIG_VALUES = 500_000


def _read_config_text(path: str) -> str:
    """The file's text: a regular file (a FIFO would hold a reload's loop until written) of at most
    MAX_CONFIG_BYTES (a device such as /dev/zero never ends). Raises OSError, ConfigError,
    UnicodeDecodeError."""
    with os.fdopen(disk.open_file(path, os.O_RDONLY), "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(path, f"larger than {MAX_CONFIG_BYTES:,} bytes: not a config file")
    return raw.decode("utf-8")


def _check_values(path: str, text: str) -> None:
    """Refuse a file writing more than MAX_CONFIG_VALUES values, counted as YAML reads them, one at a
    time: each value composed is an object of about 500 bytes (a 4 MB list of numbers took a
    gigabyte and 15 s, and a reload of it held that until it failed). Raises yaml.YAMLError too."""
    loader = _ConfigLoader(text)
    try:
        count = 0
        while loader.check_event():
            loader.get_event()
            count += 1
            if count > MAX_CONFIG_VALUES:
                raise ConfigError(path, f"writes more than {MAX_CONFIG_VALUES:,} values: not a config file")
    finally:
        loader.dispose()


def _check_expansion(path: str, composed: yaml.Node | None) -> None:
    """Refuse a file whose aliases expand it past MAX_EXPANDED_VALUES values or MAX_EXPANDED_BYTES
    bytes more than it writes (a large file without aliases expands to itself)."""
    sizes: dict[int, tuple[int, int]] = {}
    values, size = _expanded_size(composed, sizes)
    written = sum(len(node.value) for node in _nodes(composed) if isinstance(node, yaml.ScalarNode))
    if values - len(sizes) > MAX_EXPANDED_VALUES or size - written > MAX_EXPANDED_BYTES:
        raise ConfigError(path, f"its YAML aliases (*name) expand to more than {MAX_EXPANDED_VALUES:,} "
                                f"values or {MAX_EXPANDED_BYTES:,} bytes beyond what it writes: not a config "
                                "file")


def _nodes(node: yaml.Node | None) -> Iterator[yaml.Node]:
    """Each node of the document once, its aliases not followed again."""
    seen: set[int] = set()
    todo = [node] if node is not None else []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(_children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    """A mapping's keys and values, a sequence's items, a scalar's nothing."""
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_size(node: yaml.Node | None, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """How many values `node` holds with every alias expanded, and how many bytes of text, each node
    counted once (`sizes`)."""
    if node is None:
        return 0, 0
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = (1, 0)  # (a node within itself: YAML allows it; counted once)
    if isinstance(node, yaml.ScalarNode):
        size = (1, len(node.value))
    else:
        counted = [_expanded_size(child, sizes) for child in _children(node)]
        size = (1 + sum(c[0] for c in counted), sum(c[1] for c in counted))
    sizes[id(node)] = size
    return size


class _NodeError(ConfigError):
    """A ConfigError found in the document's nodes; `fatal`: YAML cannot build the value at all."""

    def __init__(self, key: str, reason: str, fatal: bool = False) -> None:
        super().__init__(key, reason)
        self.fatal = fatal


def _node_errors(node: yaml.Node | None, path: str = "") -> list[_NodeError]:
    """What the document's nodes show wrong before YAML builds them: a key given twice in one
    mapping (YAML would keep the last silently), and a number longer than Python reads (YAML's
    reading of it failed with a traceback naming no key)."""
    found: list[_NodeError] = []
    if isinstance(node, yaml.ScalarNode):
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_NUMBER_DIGITS:
            found.append(_NodeError(path or "(config)", f"a number of {len(node.value):,} digits: no setting "
                                    "takes one", fatal=True))
    elif isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            where = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen:
                found.append(_NodeError(where, f"given twice, on lines {seen[key]} and {line}; keep one"))
            else:
                seen[key] = line
            found.extend(_node_errors(key_node, where))
            found.extend(_node_errors(value_node, where))
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            found.extend(_node_errors(item, f"{path}[{n}]"))
    return found


def with_overrides(config: ServerConfig, **overrides: Any) -> ServerConfig:
    """The config with command-line values (None = not given) laid over it."""
    given = {k: v for k, v in overrides.items() if v is not None}
    collect = _Collector()
    for key, value in given.items():
        collect.check(_PARSERS[key], f"--{key.replace('_', '-')}", value)
    collect.raise_any()
    config = dataclasses.replace(config, **given, overridden=tuple(given))
    _check_ports(functools.partial(getattr, config),
                 lambda field: f"--{field.replace('_', '-')}" if field in given else field)
    return config
