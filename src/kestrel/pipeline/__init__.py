"""Spark data sources for Kestrel: journals as DataFrames, DataFrames into queues, queues as streams.

    from kestrel.pipeline import register
    register(spark)   # adds the formats "kestrel-journal" and "kestrel"

Installed with the `spark` extra, both formats are also found by Spark on its own (the top-level
modules `pyspark_kestrel` and `pyspark_kestrel_journal`).
"""

from __future__ import annotations

from typing import Any

from kestrel.pipeline.drain import drain


def register(spark: Any) -> None:
    """Register both data sources with a SparkSession."""
    from kestrel.pipeline.journal_source import KestrelJournalDataSource
    from kestrel.pipeline.kestrel_source import KestrelDataSource

    spark.dataSource.register(KestrelJournalDataSource)
    spark.dataSource.register(KestrelDataSource)


__all__ = ["drain", "register"]
