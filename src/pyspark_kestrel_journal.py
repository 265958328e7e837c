"""Found by Spark's data source lookup (a top-level `pyspark_*` module with `DefaultSource`)."""

from kestrel.pipeline.journal_source import KestrelJournalDataSource as DefaultSource

__all__ = ["DefaultSource"]
