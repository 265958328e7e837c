"""Kestrel's text protocol: the command parser and the connection handler."""
