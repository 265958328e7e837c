"""Offline tools over a queue path: `dump` prints records, `convert` moves queues between formats.

The live server never imports them.
"""
