"""One connection's work does not hold the loop: connections take turns (src/kestrel/service/turns.py).

Clients pipelining requests without end once held the loop: a light Thrift client behind one Thrift
flooder was never answered, and behind ten memcache flooders it waited about 450 ms a round. Here
every light round must be answered, none after STALL_S: what a loaded machine cannot break. How
long the rounds take (a few milliseconds, beside Redis under the same flood) is bench/bench_fairness.py's
figure, with bench/README.md's.
"""

from __future__ import annotations

import pytest

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.flood import Flooder, Light
from tests.support.thrift_wire import encode_call, framed
from tests.support.wire import shared_server  # noqa: F401  (the module's `server`)

ROUNDS = 20

VERSION = framed(encode_call("binary", "get_version"))


def light_rounds(light: Light) -> list[float]:
    return [light.round() for _ in range(ROUNDS)]  # TimeoutError (starved) before connections took turns


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
        wait_until(lambda: all(f.received for f in flooders), "every flooder answered: the flood under way")
        before = sum(f.received for f in flooders)
        rounds = light_rounds(light)
        # ... and the flood goes on: the light client was served beside the flooders, not instead of
        # them. (Waited for: on a loaded machine the flooders' threads may not have run during the
        # light rounds, which can take a few milliseconds in all.)
        wait_until(lambda: sum(f.received for f in flooders) > before, "the flood going on beside the light client")
    finally:
        for f in flooders:
            f.stop()
        light.close()
    assert max(rounds) < STALL_S, f"a light round took {max(rounds) * 1000:.0f} ms"
    assert "Traceback" not in server.log()
