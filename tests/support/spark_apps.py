"""Spark applications run as users run them: a Python script in a process of its own, started with
spark-submit's settings in PYSPARK_SUBMIT_ARGS (for the README's example, the example job, a job on a
standalone cluster)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from tests.conftest import ROOT


def app_environment(spark_dir: Path, **conf: str) -> dict[str, str]:
    """This environment minus PYTHONPATH and PYSPARK_PYTHON (set by the Spark tests of this process),
    plus what makes an application cheaper, as tests/pipeline/test_pipeline.py does: a JVM that starts fast, no
    web UI, Spark's files under `spark_dir`, and every Python worker importing pyspark precompiled
    (tests/support/spark_python.sh: the same Python). From Spark's zip each worker compiles pyspark anew, and
    on a loaded machine the streaming source's worker then missed Spark's 10 s to connect back.
    `conf`: more Spark settings."""
    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": "1", "spark.python.unix.domain.socket.enabled": "true",
                "spark.sql.streaming.pollingDelay": "50ms", "spark.local.dir": str(spark_dir), **conf}
    submit = " ".join(f"--conf {shlex.quote(f'{key}={value}')}" for key, value in settings.items())
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON")}
    environment.update({
        "PYSPARK_SUBMIT_ARGS": f"{submit} --driver-java-options '-XX:TieredStopAtLevel=1 -XX:+UseSerialGC' "
                               "pyspark-shell",
        "PYSPARK_PYTHON": str(ROOT / "tests" / "support" / "spark_python.sh"),
        "PYSPARK_DRIVER_PYTHON": str(ROOT / "tests" / "support" / "spark_python.sh"),
        "KESTREL_SPARK_PYTHON": sys.executable,
    })
    return environment
