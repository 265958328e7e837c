"""Every protocol fuzzed over real sockets (a sample; bench/fuzz_servers.py runs 10^5 per protocol and
reports the good client's latency).

4000 inputs a protocol reach nearly every server line that 10^4 reach, at 40% of the time: with
coverage of service/ and storage/ (2026-11-23), memcache 3788 lines of 3797, text 3661 of 3666,
Thrift buffered binary 3586 of 3601, framed compact 3609 of 3612; most of the rest are the queue's
timing-dependent paths, 1 to 3 lines the Thrift reader's. 2000 inputs left 8 to 38 unreached.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.fuzz_harness import SERVER_SETTINGS, run, targets

SAMPLE = int(os.environ.get("KESTREL_FUZZ_SAMPLE", "4000"))
# What the server may keep per input: a leak of 10 KB an input shows at any sample size.
RSS_GROWTH_PER_INPUT_KB = 10
TARGETS = targets()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_mutated_inputs_harm_nobody(server_factory: Any, name: str) -> None:
    target = TARGETS[name]
    srv = server_factory({**SERVER_SETTINGS, **target.settings})
    report = run(srv, target, SAMPLE)
    print(f"{name}: {report.summary()}")
    assert report.alive, srv.log()[-3000:]
    log = srv.log()
    assert report.tracebacks == [], log[log.find("Traceback") - 2000:][:6000]  # the first, in context
    assert report.good_errors == []
    assert report.good_rounds > 0
    assert report.rss_peak_kb - report.rss_start_kb < RSS_GROWTH_PER_INPUT_KB * SAMPLE, report.summary()
    # Served throughout: no round waited seconds. How quickly it was served (p99 under 100 ms) is
    # bench/fuzz_servers.py's figure, beside memcached's under the same inputs.
    assert not report.stalled(), report.summary()
