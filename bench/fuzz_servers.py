"""Fuzz every protocol's parser over real sockets: 10^5 mutated inputs per protocol by default.

The same harness as tests/test_fuzz_wire.py (which runs a 10^4 sample in the normal test run):
fresh servers as subprocesses, fuzz workers sending mutated request streams, a well-behaved client
checking every reply. Prints one row per protocol and exits non-zero if any check fails (server
died, a traceback in its log, a wrong reply, RSS grew by 100 MB, the good client waited over 100 ms beyond
the budget `Report.within_latency_budget` explains).

    .venv/bin/python -m bench.fuzz_servers [--count 100000] [--only thrift-framed-binary] [--seed 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine
from tests.conftest import ServerProcess
from tests.fuzz_harness import SERVER_SETTINGS, run, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--only", choices=sorted(targets()))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# fuzz, {time.strftime('%Y-%m-%d')}, {machine()}; {args.count} inputs per protocol, "
          f"seed {args.seed}")
    failed = False
    for name, target in sorted(targets().items()):
        if args.only and name != args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="kestrel-fuzz-") as work:
            srv = ServerProcess(Path(work), {**SERVER_SETTINGS, **target.settings}).start()
            try:
                report = run(srv, target, args.count, args.seed)
            finally:
                srv.stop()
        grew = report.rss_peak_kb - report.rss_start_kb >= 100 * 1024
        bad = (not report.alive or report.tracebacks or report.good_errors or grew
               or not report.within_latency_budget())
        failed = failed or bool(bad)
        print(f"{name:<24} {'FAIL' if bad else 'ok  '} {report.summary()}")
        for line in (report.good_errors + report.tracebacks)[:5]:
            print(f"    {line[:300]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
