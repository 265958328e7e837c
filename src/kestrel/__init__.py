"""Kestrel: a simple, durable FIFO queue server (Thrift, memcache and text protocols).

`kestrel.storage` is the storage engine, usable as a library; `kestrel.service` the server;
`kestrel.client` the Python client; `kestrel.pipeline` the Spark data sources; `kestrel.contract`
the Thrift contract. `python -m kestrel` is the `kestrel` command.
"""

__version__ = "0.1.0"

# The version every face of the server reports (memcache VERSION and STAT version, the text
# protocol, Thrift's get_version, /metrics, `kestrel --version`): the Kestrel release whose
# protocols it speaks, then this package's. libmemcached's tools refuse a major version of 0.
SERVER_VERSION = f"2.4.1-py{__version__}"
