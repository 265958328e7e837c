"""One connection's work does not hold the loop: connections take turns (service/turns.py).

Clients pipelining requests without end once held the loop: a light Thrift client behind one Thrift
flooder was never answered, and behind ten memcache flooders it waited about 450 ms a round. The
bound below only catch such a stall (the light client's rounds now cost a few milliseconds, see
bench/README.md for the figures beside Redis); they do not time the server.
"""

from __future__ import annotations

import statistics
import time

import pytest

from tests.conftest import ServerProcess
from tests.flood import Flooder, Light
from tests.thrift_wire import encode_call, framed
from tests.wire import shared_server  # noqa: F401  (the module's `server`)

ROUNDS = 20
STALL = 0.2  # seconds: a light round's median above this means a connection held the loop

VERSION = framed(encode_call("binary", "get_version"))


def light_median(light: Light) -> float:
    times = []
    for _ in range(ROUNDS):
        times.append(light.round())
        time.sleep(0.002)
    return statistics.median(times)


@pytest.mark.parametrize("protocol, flood_request, light_request, reply_end", [
    ("thrift", VERSION, VERSION, None),
    ("memcache", b"get none\r\n", b"get none\r\n", b"END\r\n"),
])
def test_a_light_client_is_served_while_others_pipeline_without_end(
        server: ServerProcess, protocol: str, flood_request: bytes, light_request: bytes,
        reply_end: bytes | None) -> None:
    port = getattr(server, f"{protocol}_port")
    light = Light(port, light_request, reply_end or b"", framed_reply=reply_end is None)
    flooders = [Flooder(port, flood_request) for _ in range(10)]
    try:
        time.sleep(0.3)  # the flood is under way
        median = light_median(light)  # TimeoutError (starved) before connections took turns
    finally:
        for f in flooders:
            f.stop()
        light.close()
    assert median < STALL, f"a light round took {median * 1000:.0f} ms (median of {ROUNDS})"
    assert "Traceback" not in server.log()
