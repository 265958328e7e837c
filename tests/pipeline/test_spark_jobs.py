"""Spark applications in processes of their own, as users run them: the example job twice on one
output path, a job on a standalone cluster of two workers that the test starts, and a job finding
the data sources of the installed wheel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is installed by `make test` (the spark extra)")

# Deadlines for a hung Spark, not budgets: on a loaded machine a Spark application takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

from tests.conftest import ROOT, ServerProcess, free_ports, wait_for  # noqa: E402
from tests.support.spark_apps import app_environment  # noqa: E402
from tests.support.system import need_java  # noqa: E402
from tests.support.wheel import build_wheel  # noqa: E402

EXAMPLE = ROOT / "src" / "kestrel" / "pipeline" / "examples" / "produce_and_consume.py"


def queue_info(srv: ServerProcess, queue: str) -> tuple[int, int]:
    from kestrel.client import Server

    with Server("127.0.0.1", srv.thrift_port) as server:
        info = server.peek(queue)
        return int(info.items), int(info.open_transactions)


def run_app(command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, f"{command[1]} failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return done.stdout


def test_the_example_job_runs_twice_on_one_output_path(server: ServerProcess, tmp_path: Path) -> None:
    need_java()
    out = tmp_path / "out"
    command = [sys.executable, str(EXAMPLE), "--servers", f"127.0.0.1:{server.thrift_port}", "--rows", "2000",
               "--out", str(out)]
    for _ in range(2):  # the second run finds the first one's output and checkpoint, and goes on from them
        printed = run_app(command, app_environment(tmp_path / "spark"), tmp_path)
        assert "produced 2,000 rows" in printed and "consumed 2,000 distinct rows" in printed, printed
        assert queue_info(server, "example") == (0, 0)


# The job: rows put by the writer's tasks, looked at by a batch read, taken by an AvailableNow stream
# into Parquet, counted; then how many executors ran it (the driver is listed among them).
CLUSTER_JOB = """
import sys
from pyspark.sql import SparkSession

servers, out = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.appName("kestrel-on-a-cluster").getOrCreate()
rows = spark.range(0, 20000, numPartitions=4).selectExpr("concat('job-', cast(id as string)) as data")
rows.write.format("kestrel").option("servers", servers).option("queue", "jobs").mode("append").save()
looked = spark.read.format("kestrel").option("servers", servers).option("queue", "jobs") \\
    .option("maxItems", 100000).load()
print("looked", looked.count(), looked.select("server").distinct().count())
query = spark.readStream.format("kestrel").option("servers", servers).option("queue", "jobs") \\
    .option("checkpointLocation", out + "/cp").option("maxItemsPerTrigger", 8000).option("minPartitions", 4) \\
    .load().writeStream.format("parquet").option("path", out + "/data").option("checkpointLocation", out + "/cp") \\
    .trigger(availableNow=True).start()
query.awaitTermination()
taken = spark.read.parquet(out + "/data")
print("taken", taken.count(), taken.select("data").distinct().count())
print("executors", spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1)
spark.stop()
"""


class Standalone:
    """A Spark standalone master and its workers, each a process of its own (`spark-class`)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_ports(1, owner=self)[0]
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")

    def _start(self, name: str, *args: str) -> Path:
        log = self.workdir / f"{name}.log"
        env = dict(app_environment(self.workdir / name), SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        env.pop("PYSPARK_SUBMIT_ARGS")
        with open(log, "ab") as out:
            self.procs.append(subprocess.Popen([self.spark_class, *args], cwd=self.workdir, env=env, stdout=out,
                                               stderr=out, start_new_session=True))
        return log

    def start(self, workers: int) -> Standalone:
        master_log = self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                 "--port", str(self.port), "--webui-port", "0")
        for i in range(workers):
            (self.workdir / f"work-{i}").mkdir()
            self._start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                        "--webui-port", "0", "--cores", "1", "--memory", "1g",
                        "--work-dir", str(self.workdir / f"work-{i}"), self.url)
        wait_for(self.procs[0], lambda: master_log.read_text(errors="replace").count("Registering worker")
                 >= workers, f"{workers} workers registered with the master", timeout=300)
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):  # each JVM's process group: spark-class runs java as a child
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """One cluster for the module's jobs, each an application of its own."""
    need_java()
    cluster = Standalone(tmp_path_factory.mktemp("standalone"))
    try:
        yield cluster.start(workers=2)
    finally:
        cluster.stop()


def cluster_environment(standalone: Standalone, spark_dir: Path, **more: str) -> dict[str, str]:
    return app_environment(spark_dir, **{
        "spark.master": standalone.url, "spark.cores.max": "2", "spark.executor.cores": "1",
        "spark.executor.memory": "512m", "spark.driver.host": "127.0.0.1",
        "spark.executorEnv.KESTREL_SPARK_PYTHON": sys.executable,
        "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC", **more})


# On a machine loaded enough, importing pyspark takes longer than Spark's fixed 10 s for a streaming
# source's Python process to connect back: this makes that import take 12 s in that process alone
# (found by the command line it started with), wherever it is put on PYTHONPATH.
SLOW_START = """
import sys, time

if "pyspark.sql.streaming.python_streaming_source_runner" in sys.orig_argv:
    class SlowPyspark:
        def find_spec(self, name, path=None, target=None):
            if name == "pyspark":
                sys.meta_path.remove(self)
                time.sleep(12)
            return None

    sys.meta_path.insert(0, SlowPyspark())
"""


def test_a_job_on_a_standalone_cluster_of_two_workers(standalone: Standalone, server_factory: Any,
                                                      tmp_path: Path) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    servers = f"127.0.0.1:{a.thrift_port},127.0.0.1:{b.thrift_port}"
    job = tmp_path / "job.py"
    job.write_text(CLUSTER_JOB)
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_START)  # the stream's Python starts as on a loaded machine
    env = dict(cluster_environment(standalone, tmp_path / "spark"), PYTHONPATH=str(slow))
    printed = run_app([sys.executable, str(job), servers, str(tmp_path / "out")], env, tmp_path).splitlines()
    assert "looked 20000 2" in printed, printed  # every row, from both servers, and all left in place
    assert "taken 20000 20000" in printed, printed  # each item once
    assert "executors 2" in printed, printed  # one on each worker
    assert queue_info(a, "jobs") == (0, 0) and queue_info(b, "jobs") == (0, 0)


# The job: a stream whose checkpoint is a path each process resolves in its own working directory,
# as a local path on each host of a cluster is each host's own.
PRIVATE_CHECKPOINT_JOB = """
import sys
from pyspark.sql import SparkSession

servers, out = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.appName("kestrel-private-checkpoint").getOrCreate()
cp = "/proc/self/cwd/kestrel-cp"
query = spark.readStream.format("kestrel").option("servers", servers).option("queue", "jobs") \\
    .option("checkpointLocation", cp).load().writeStream.format("parquet").option("path", out + "/data") \\
    .option("checkpointLocation", cp).trigger(availableNow=True).start()
try:
    query.awaitTermination()
    print("finished")
except Exception as e:
    print("failed:", " ".join(str(e).split()))
spark.stop()
"""


def test_a_checkpoint_the_executors_do_not_share_fails_the_query_naming_it(standalone: Standalone,
                                                                           server: ServerProcess,
                                                                           tmp_path: Path) -> None:
    from kestrel.client import Server

    with Server("127.0.0.1", server.thrift_port) as client:
        client.put("jobs", [b"%d" % i for i in range(2000)])
    job = tmp_path / "job.py"
    job.write_text(PRIVATE_CHECKPOINT_JOB)
    env = cluster_environment(standalone, tmp_path / "spark")
    printed = run_app([sys.executable, str(job), f"127.0.0.1:{server.thrift_port}", str(tmp_path / "out")], env,
                      tmp_path)
    assert "failed:" in printed and "does not see the checkpoint the driver wrote at /proc/self/cwd/kestrel-cp" \
        in printed and "Nothing was taken" in printed, printed
    assert queue_info(server, "jobs") == (2000, 0)  # nothing taken, nothing left open


# The job: both formats by name alone (no register), then where the driver and a Python worker
# import the package from, and what their sys.path holds (each entry resolved where it is read: ""
# is that process's working directory).
FINDING_JOB = """
import json, os, sys
import kestrel
from pyspark.sql import SparkSession

servers, queue_path = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.appName("kestrel-installed").getOrCreate()
looked = spark.read.format("kestrel").option("servers", servers).option("queue", "found").load()
journal = spark.read.format("kestrel-journal").option("view", "items").option("queue", "found").load(queue_path)

def where(_):
    import os, sys
    import kestrel, pyspark_kestrel, pyspark_kestrel_journal
    yield json.dumps([kestrel.__file__, pyspark_kestrel.__file__, pyspark_kestrel_journal.__file__,
                      [os.path.realpath(p) for p in sys.path]])

worker = json.loads(spark.sparkContext.parallelize([0], 1).mapPartitions(where).collect()[0])
print(json.dumps({"looked": sorted(r.data.decode() for r in looked.collect()),
                  "journal": [r.data.decode() for r in journal.orderBy("position").collect()],
                  "driver": [kestrel.__file__, [os.path.realpath(p) for p in sys.path]], "worker": worker}))
spark.stop()
"""


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh `venv --without-pip` Python with the built wheel installed in its site-packages (as
    `pip install kestrel_py-*.whl` does, `kestrel-pyspark-python.pth` included), reaching pyspark
    and the other dependencies in .venv through PYTHONPATH, which, unlike .venv's own site directory,
    does not read the editable install's .pth (the line that would put the repository's src/ on
    sys.path), in the pure build KESTREL_PURE_PYTHON=1 asks for (quicker to make); and a folder
    outside the repository holding FINDING_JOB. (Python, folder.)"""
    work = tmp_path_factory.mktemp("wheel")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                           "--target", site, str(build_wheel(work, pure=True))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    # Nothing of the request path compiled.
    assert not list(Path(site).glob("kestrel__mypyc*")) and not list((Path(site) / "kestrel" / "service").glob(
        "turns.*.so")), sorted(p.name for p in Path(site).rglob("*.so"))
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "job.py").write_text(FINDING_JOB)
    return python, elsewhere


def check_found(printed: list[str], python: Path, server: ServerProcess) -> None:
    found = json.loads(printed[-1])
    assert found["looked"] == ["one", "two"]
    assert found["journal"] == ["one", "two"]
    assert queue_info(server, "found") == (2, 0)  # looked at, left in place
    kestrel_file, driver_path = found["driver"]
    *modules, worker_path = found["worker"]
    installed = python.parent.parent.resolve()
    for module in (kestrel_file, *modules):
        assert Path(module).resolve().is_relative_to(installed), module
    # Under the repository, only .venv's site-packages (pyspark, its jars and the other dependencies),
    # never src/, the root, or any other folder of it.
    dependencies = Path(sysconfig.get_paths()["purelib"]).resolve()
    for entry in driver_path + worker_path:
        where = Path(entry)
        assert where.is_relative_to(dependencies) or not where.is_relative_to(ROOT.resolve()), \
            (entry, driver_path, worker_path)


def put_found(server: ServerProcess) -> None:
    from kestrel.client import Server

    with Server("127.0.0.1", server.thrift_port) as client:
        if client.peek("found").items == 0:
            assert client.put("found", [b"one", b"two"]) == 2


def test_an_installed_wheel_serves_both_formats_without_register(server: ServerProcess, tmp_path: Path,
                                                                 installed_wheel: tuple[Path, Path]) -> None:
    # The Python named as Spark's tests name it, in PYSPARK_PYTHON (through tests/support/spark_python.sh).
    # Driver and workers run from a folder outside the repository.
    need_java()
    python, elsewhere = installed_wheel
    put_found(server)
    env = dict(app_environment(tmp_path / "spark", **{"spark.master": "local[1]"}),
               PYTHONPATH=sysconfig.get_paths()["purelib"], KESTREL_SPARK_PYTHON=str(python))
    printed = run_app([str(python), "job.py", f"127.0.0.1:{server.thrift_port}", str(server.queue_path)], env,
                      elsewhere).splitlines()
    check_found(printed, python, server)


@pytest.mark.parametrize("launch", ["python", "spark-submit"])
def test_the_formats_are_found_with_spark_pyspark_python_alone(server: ServerProcess, tmp_path: Path,
                                                               installed_wheel: tuple[Path, Path],
                                                               launch: str) -> None:
    # The Python named only by the setting spark.pyspark.python, nothing in the environment: Spark's JVM
    # then runs the driver side of Python data sources with `python3` from PATH, which lacks the package.
    # Started by Python (a script, a notebook), or by spark-submit, which starts the JVM first.
    need_java()
    python, elsewhere = installed_wheel
    put_found(server)
    env = {k: v for k, v in app_environment(tmp_path / "spark").items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "KESTREL_SPARK_PYTHON", "PYSPARK_SUBMIT_ARGS")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    settings = ["--master", "local[1]", "--conf", "spark.ui.enabled=false", "--conf",
                f"spark.local.dir={tmp_path / 'spark'}", "--conf", f"spark.pyspark.python={python}"]
    arguments = [f"127.0.0.1:{server.thrift_port}", str(server.queue_path)]
    if launch == "python":
        env["PYSPARK_SUBMIT_ARGS"] = " ".join([*settings, "pyspark-shell"])
        command = [str(python), "job.py", *arguments]
    else:
        command = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), *settings, "job.py", *arguments]
    printed = run_app(command, env, elsewhere).splitlines()
    check_found(printed, python, server)
