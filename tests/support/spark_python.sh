#!/bin/sh
# The Python that Spark starts for its workers in the tests (PYSPARK_PYTHON). Spark puts its own
# pyspark.zip first on a worker's PYTHONPATH, and from a zip every new worker compiles pyspark
# anew (about 0.8 CPU-seconds each: a daemon per worker module, a process per streaming query).
# The zip is a file of the installed pyspark package itself, so the same code is imported
# precompiled from site-packages once the zips are left out.
PYTHONPATH=$(printf '%s' "$PYTHONPATH" | tr ':' '\n' | grep -v '/pyspark/python/lib/' | paste -sd: -)
export PYTHONPATH
# A streaming source's process must connect back within Spark's fixed 10 s: it connects before
# importing pyspark (tests/support/spark_connect_first.py).
if [ "$1" = "-m" ] && [ "$2" = "pyspark.sql.streaming.python_streaming_source_runner" ]; then
    exec "$KESTREL_SPARK_PYTHON" "$(dirname "$0")/spark_connect_first.py" "$2"
fi
exec "$KESTREL_SPARK_PYTHON" "$@"
