"""The network edges of the Kestrel server: Thrift, memcache, text and admin HTTP, on gevent."""

__version__ = "0.1.0"
