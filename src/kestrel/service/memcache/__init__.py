"""Kestrel's memcache protocol: the command parser and the connection handler."""
