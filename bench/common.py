"""What the benchmark scripts share: free ports, waiting for a listener, the machine's description."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def machine() -> str:
    """Cores, CPU model, kernel and Python, for the header of every table."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return f"{os.cpu_count()} cores, {cpu}, Linux {platform.release()}, Python {platform.python_version()}"


def load_average() -> str:
    """The 1, 5 and 15-minute load averages: how busy the shared machine was around a run."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f} on {os.cpu_count()} cores"


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` and all its threads so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
