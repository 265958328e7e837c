"""The cluster's ZooKeeper settings, judged by the rules that read them: kazoo's for the ensemble's
connection string, ZooKeeper's for the server sets' parent path.

The server (its `zookeeper` config block) and the client (`Cluster.from_zookeeper`) take the same
two settings, and a value that passes here is one kazoo and ZooKeeper accept: a bad one is refused
where it is given, not found later by a membership that never joins or a watch that never starts.
"""

from __future__ import annotations

import re

from kazoo.hosts import collect_hosts
from kazoo.protocol.paths import normpath

# The characters ZooKeeper refuses in a path (its PathUtils.validatePath): NUL, the control
# characters, and the private-use and special ranges.
_REFUSED = re.compile("[\u0000-\u001f\u007f-\u009f\ud800-\uf8ff\ufff0-\uffff]")


def checked_hosts(hosts: object) -> str:
    """ZooKeeper's connection string (`zk1:2181,zk2:2181[/chroot]`) as kazoo reads it; raises
    ValueError saying what is wrong."""
    if not isinstance(hosts, str) or not hosts.strip() or not hosts.isprintable():  # no NUL in a host name
        raise ValueError(f"expected the ZooKeeper ensemble, e.g. \"zk1:2181,zk2:2181\", got {hosts!r}")
    try:
        _, chroot = collect_hosts(hosts)
        if chroot is not None:
            checked_path(chroot)
    except ValueError as e:
        raise ValueError(f"{e}: expected host:port[,host:port...][/chroot], got {hosts!r}") from None
    return hosts


def checked_path(path: object) -> str:
    """An absolute ZooKeeper path, without its trailing `/`; raises ValueError saying what is wrong."""
    if not isinstance(path, str):
        raise ValueError(f"expected an absolute ZooKeeper path such as /kestrel, got {path!r}")
    stripped = path.rstrip("/")
    if not stripped.startswith("/") or "//" in stripped:
        raise ValueError(f"expected an absolute ZooKeeper path such as /kestrel, got {path!r}")
    refused = _REFUSED.search(stripped)
    if refused:
        raise ValueError(f"ZooKeeper refuses the character {refused.group()!r} in a path, got {path!r}")
    try:
        normpath(stripped)
    except ValueError as e:  # `.` or `..` as a node's name
        raise ValueError(f"{e} in ZooKeeper: expected no . or .. node, got {path!r}") from None
    return stripped
