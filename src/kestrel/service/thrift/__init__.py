"""Kestrel's Thrift service: the binary and compact wire protocols, framing, calls and replies."""
