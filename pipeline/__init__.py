"""Spark data sources for Kestrel: journals as DataFrames, DataFrames into queues, queues as streams."""
