"""Lets `spark.pyspark.python` name the Python of Spark's driver side too, so that Spark finds the sources.

PySpark 4.3 runs the driver side of a Python data source (finding it by name, planning, a stream's
offsets) with the Python that PYSPARK_DRIVER_PYTHON or PYSPARK_PYTHON names in the environment of
Spark's JVM, else with `python3` from its PATH; the `spark.pyspark.python` setting reaches the
executors and the driver's own Python process, not that one. Where that Python lacks this package,
`format("kestrel")` is DATA_SOURCE_NOT_FOUND. `kestrel-pyspark-python.pth`, installed with the
package, imports this module when its Python starts; it does nothing until pyspark is imported, and
then, in a driver:

- where this Python starts Spark's JVM (a script run with Python, a notebook), it hands the JVM the
  settings `spark.pyspark.python` and `spark.pyspark.driver.python` (from the SparkConf or
  PYSPARK_SUBMIT_ARGS) as the environment variables Spark reads there, where they are not set;
- where Spark's JVM started this Python (`spark-submit job.py`, which sets PYSPARK_PYTHON for this
  process from the setting, but not for itself), it registers the sources with each session the
  driver gets, when the JVM's Python is another one.

At start-up it imports nothing beyond what every Python has loaded by then (`os`, `sys`, importlib).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

SETTINGS = (("spark.pyspark.driver.python", "PYSPARK_DRIVER_PYTHON"),
            ("spark.pyspark.python", "PYSPARK_PYTHON"))


def submit_settings(args: str) -> dict[str, str]:
    """The `--conf key=value` settings of spark-submit arguments (PYSPARK_SUBMIT_ARGS)."""
    import shlex

    words = shlex.split(args)
    settings: dict[str, str] = {}
    for i, word in enumerate(words):
        if word == "--conf" and i + 1 < len(words):
            pair = words[i + 1]
        elif word.startswith("--conf="):
            pair = word.removeprefix("--conf=")
        else:
            continue
        key, equals, value = pair.partition("=")
        if equals:
            settings[key.strip()] = value
    return settings


def export_python_settings(conf: Any) -> None:
    """Before this Python starts Spark's JVM: the Python settings as the environment variables the
    JVM reads (a variable already set wins, as it does in Spark)."""
    settings = submit_settings(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    if conf is not None:
        settings.update(dict(conf.getAll()))
    for key, variable in SETTINGS:
        if settings.get(key) and not os.environ.get(variable):
            os.environ[variable] = settings[key]


def _same_python(a: str, b: str) -> bool:
    import shutil

    return os.path.realpath(shutil.which(a) or a) == os.path.realpath(shutil.which(b) or b)


def register_where_unseen(session: Any) -> None:
    """Where Spark's JVM started this Python: register the sources with `session` when the JVM's
    Python for data sources is not the one this process was told to use (PYSPARK_PYTHON)."""
    python = os.environ.get("PYSPARK_DRIVER_PYTHON") or os.environ.get("PYSPARK_PYTHON")
    started_by_jvm = "PYSPARK_GATEWAY_PORT" in os.environ
    if not python or not started_by_jvm or getattr(session, "_kestrel_registered", False):
        return
    try:  # what PySpark's PythonUtils.defaultPythonExec reads, in the JVM's environment
        getenv = session._jvm.java.lang.System.getenv
        jvm_python = getenv("PYSPARK_DRIVER_PYTHON") or getenv("PYSPARK_PYTHON") or "python3"
    except Exception:  # a Spark Connect session has no JVM here: nothing to do
        return
    if not _same_python(jvm_python, python):
        from kestrel.pipeline import register

        register(session)
    session._kestrel_registered = True


def _after_gateway_module(module: ModuleType) -> None:
    launch = module.launch_gateway

    def launch_gateway(conf: Any = None, popen_kwargs: Any = None) -> Any:
        if "PYSPARK_GATEWAY_PORT" not in os.environ:
            export_python_settings(conf)
        return launch(conf, popen_kwargs)

    setattr(module, "launch_gateway", launch_gateway)  # noqa: B010 (a module attribute typeshed does not know)


def _after_session_module(module: ModuleType) -> None:
    builder = module.SparkSession.Builder
    get_or_create = builder.getOrCreate

    def getOrCreate(self: Any) -> Any:  # noqa: N802 (pyspark's name)
        session = get_or_create(self)
        register_where_unseen(session)
        return session

    builder.getOrCreate = getOrCreate


AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    "pyspark.java_gateway": _after_gateway_module,
    "pyspark.sql.session": _after_session_module,
}


class Adjusting:
    """A module's loader, then an adjustment of the module it ran (a loader may serve many modules,
    as a zip's does: it is wrapped, not changed)."""

    def __init__(self, loader: Any, adjust: Callable[[ModuleType], None]) -> None:
        self.loader, self.adjust = loader, adjust

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.adjust(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AfterImport:
    """A finder that lets the usual one find these modules, then adjusts each once it has run."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        adjust = AFTER_IMPORT.get(name)
        if adjust is None:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = Adjusting(spec.loader, adjust)  # type: ignore[assignment]
        return spec


def install() -> None:
    if not any(isinstance(finder, AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport())


install()
