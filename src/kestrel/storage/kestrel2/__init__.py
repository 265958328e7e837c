"""Kestrel 2's journal format: one append-only journal per queue (the seeds' kestrel-journal-format).

`codec.py` alone knows the byte layout; `reader.py` reads records back; `journal.py` is a queue's
file set (append, rotate, pack); `replay.py` rebuilds a queue; `read_behind.py` and `checkpoints.py`
page a long queue out of memory; `packer.py` packs rotated files; `queue.py` is the format's queue.
"""
