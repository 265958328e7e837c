"""Fuzz every protocol's parser over real sockets: 10^5 mutated inputs per protocol by default.

The same harness as tests/end_to_end/test_fuzz_wire.py (which runs a sample of 4000 in the normal test run):
fresh servers as subprocesses, fuzz workers sending mutated request streams, a well-behaved client
checking every reply. Prints one row per protocol and exits non-zero if any check fails (server
died, a traceback in its log, a wrong reply, RSS grew by 100 MB, or the good client's latency over
the budget `Report.within_latency_budget` explains: p99 under 100 ms, at most 1% of rounds over
100 ms, none over 2 s). The test keeps every check but the latency budget, which a loaded machine
breaks without any fault of the server's; this is where it is measured.

Beside the memcache row, memcached under the same inputs and the same good client (`set` then `get`
of its own key) gives the peer's figures from the same run: the ratio of the p99s is what carries
over from one machine (and one load) to another.

    .venv/bin/python -m bench.fuzz_servers [--count 100000] [--only thrift-framed-binary] [--seed 1]
                                           [--no-peer]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import load_average, machine, stat_fields
from bench.peers import MissingPeer, memcached
from tests.conftest import ServerProcess
from tests.support.fuzz_harness import SERVER_SETTINGS, Report, Target, fuzz, run, targets


def memcached_row(target: Target, count: int, seed: int) -> tuple[Report | None, str]:
    """The good client's figures on memcached under the same inputs, or why there are none."""
    try:
        with tempfile.TemporaryDirectory(prefix="kestrel-fuzz-peer-") as work, memcached(Path(work)) as peer:
            report = fuzz(peer["memcache"], peer.pid, target, count, seed)
            stat = Path(f"/proc/{peer.pid}/stat")
            report.alive = stat.exists() and stat_fields(stat.read_text())[1][0] != "Z"
            return report, ""
    except MissingPeer as e:
        return None, str(e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--only", choices=sorted(targets()))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-peer", action="store_true", help="leave memcached out")
    args = parser.parse_args()
    print(f"# fuzz, {time.strftime('%Y-%m-%d')}, {machine()}; {args.count} inputs per protocol, "
          f"seed {args.seed}; load {load_average()}")
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
        if name == "memcache" and not args.no_peer:
            peer, why = memcached_row(target, args.count, args.seed)
            if peer is None:
                print(f"{'memcached (peer)':<24} --   {why}")
            else:
                ratio = report.latency_ms(0.99) / max(peer.latency_ms(0.99), 0.001)
                print(f"{'memcached (peer)':<24} {'ok  ' if peer.alive else 'DEAD'} {peer.summary()}; "
                      f"kestrel's p99 is {ratio:.1f}x memcached's")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
