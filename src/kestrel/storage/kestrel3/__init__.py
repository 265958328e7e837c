"""Kestrel 3's journal format: one writer journal per queue, a checkpoint per reader, so fanout
readers share one copy of the data (the seeds' kestrel3-journal-format).

`codec.py` alone knows the byte layout; `files.py` reads and writes its files; `journal.py` keeps a
queue's writer journal, shared by its readers, and their checkpoints; `queue.py` is the format's
queue, one reader.
"""
