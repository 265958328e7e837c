"""Found by Spark's data source lookup (a top-level `pyspark_*` module with `DefaultSource`)."""

from kestrel.pipeline.kestrel_source import KestrelDataSource as DefaultSource

__all__ = ["DefaultSource"]
