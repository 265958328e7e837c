"""The network edges of the Kestrel server: Thrift, memcache, text and admin HTTP, on gevent."""

# Pending connections each listener queues; bursts of thousands of clients must not lose SYNs.
LISTEN_BACKLOG = 4096
