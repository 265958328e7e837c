"""Kestrel 3's journal format: one writer journal per queue, a checkpoint per reader, so fanout
readers share one copy of the data (the seeds' kestrel3-journal-format).

`codec.py` alone knows the byte layout; `files.py` reads and writes the files; `queue.py` is the
format's queue.
"""
