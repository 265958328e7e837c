"""Spark's streaming-source worker, connected back to its JVM before pyspark is imported.

Spark 4.3 gives the Python process of a streaming source a fixed 10 s from its start to its
connection back (PythonWorkerFactory.createSimpleWorker, no setting changes it), and the module it
runs imports pyspark first: on a machine loaded by other test runs that took longer ("Python
worker failed to connect back"). This connects first, with the standard library alone (a bare
Python's start-up), then imports the module and hands it the connection. Once connected, the JVM
waits for the rest as long as it takes over a Unix socket, and for
`spark.python.authenticate.socketTimeout` over TCP. tests/support/spark_python.sh runs it in place of
`python -m pyspark.sql.streaming.python_streaming_source_runner`.
"""

import os
import runpy
import socket
import sys


def connect() -> socket.socket:
    """The connection back to the JVM, as pyspark's local_connect_and_auth opens it."""
    path = os.environ.get("PYTHON_WORKER_FACTORY_SOCK_PATH")
    if path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return sock
    host = "::1" if os.environ.get("SPARK_PREFER_IPV6", "false").lower() == "true" else "127.0.0.1"
    return socket.create_connection((host, int(os.environ["PYTHON_WORKER_FACTORY_PORT"])))


def main() -> None:
    sock = connect()
    from pyspark import util, worker_util

    def connected(conn_info: object, auth_secret: str | None) -> tuple[object, socket.socket]:
        worker_util.local_connect_and_auth = util.local_connect_and_auth  # later connections as usual
        sockfile = sock.makefile("rwb", int(os.environ.get("SPARK_BUFFER_SIZE", 65536)))
        if auth_secret is not None:  # over TCP; a Unix socket has no secret
            util._do_server_auth(sockfile, auth_secret)
        return sockfile, sock

    worker_util.local_connect_and_auth = connected
    runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
