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
    """Register both data sources with a SparkSession, each unless Spark knows it already: installed,
    Spark finds them itself (the top-level `pyspark_kestrel*` modules), and registering them again
    would replace them, with a warning each."""
    from kestrel.pipeline.journal_source import KestrelJournalDataSource
    from kestrel.pipeline.kestrel_source import KestrelDataSource

    for source in (KestrelJournalDataSource, KestrelDataSource):
        if not _known(spark, source.name()):
            spark.dataSource.register(source)


def _known(spark: Any, name: str) -> bool:
    """Whether the session has a data source of that name (False where it cannot tell, as over
    Spark Connect)."""
    try:
        return bool(spark._jsparkSession.sessionState().dataSourceManager().dataSourceExists(name))
    except AttributeError:
        return False


__all__ = ["drain", "register"]
