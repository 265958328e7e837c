"""A Python client for a Kestrel cluster: server lists or ZooKeeper server sets, batches, reliable reads.

    from kestrel.client import Cluster

    with Cluster(["kestrel1:2229", "kestrel2:2229"]) as cluster:   # or Cluster.from_zookeeper("zk:2181")
        cluster.put_many("jobs", [b"job 1", b"job 2"])
        with cluster.reliable_read("jobs", max_items=10, timeout=1.0) as items:
            ...                                                    # confirmed on success, aborted on error

It needs only the Thrift contract (`contract`), thriftpy2 and kazoo, not the server's code.
"""

from kestrel.client.cluster import Cluster
from kestrel.client.discovery import (
    ServerSource,
    StaticServers,
    ZooKeeperServerSets,
    member_address,
    parse_address,
)
from kestrel.client.errors import (
    ClientClosed,
    KestrelClientError,
    NoServers,
    Refused,
    ServerClosing,
    ServerSetsUnavailable,
    ServerUnavailable,
)
from kestrel.client.packed import PackedItems
from kestrel.client.server import Server

__all__ = [
    "ClientClosed",
    "Cluster",
    "KestrelClientError",
    "NoServers",
    "PackedItems",
    "Refused",
    "Server",
    "ServerClosing",
    "ServerSetsUnavailable",
    "ServerSource",
    "ServerUnavailable",
    "StaticServers",
    "ZooKeeperServerSets",
    "member_address",
    "parse_address",
]
