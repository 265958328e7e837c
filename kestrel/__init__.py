"""Kestrel: a simple, durable FIFO queue server (Thrift, memcache and text protocols).

`kestrel.storage` is the storage engine, usable as a library; `kestrel.service` the server;
`kestrel.client` the Python client; `kestrel.pipeline` the Spark data sources; `kestrel.contract`
the Thrift contract. `python -m kestrel` is the `kestrel` command.
"""

__version__ = "0.1.0"
