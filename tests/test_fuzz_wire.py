"""Every protocol fuzzed over real sockets (a sample; bench/fuzz_servers.py runs 10^5 per protocol)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.fuzz_harness import SERVER_SETTINGS, run, targets

SAMPLE = int(os.environ.get("KESTREL_FUZZ_SAMPLE", "10000"))
TARGETS = targets()


@pytest.mark.slow
@pytest.mark.xdist_group("latency")  # one at a time: each one's latency budget holds on an idle CPU
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_mutated_inputs_harm_nobody(server_factory: Any, name: str) -> None:
    target = TARGETS[name]
    srv = server_factory({**SERVER_SETTINGS, **target.settings})
    report = run(srv, target, SAMPLE)
    print(f"{name}: {report.summary()}")
    assert report.alive, srv.log()[-3000:]
    assert report.tracebacks == []
    assert report.good_errors == []
    assert report.good_rounds > 0
    assert report.rss_peak_kb - report.rss_start_kb < 100 * 1024
    assert report.within_latency_budget(), report.summary()
