"""Connections take turns on the one event loop: none holds it for longer than a turn.

A connection that has worked for TURN seconds without waiting for its client (one pipelining
requests, one streaming a large item) steps aside. It resumes once the loop has nothing else
ready: every other connection with input is served first, so a light client's round costs its own
time plus at most the rest of one turn of somebody else's, and a connection working alone loses
nothing (gevent's `idle` does not wait when nothing else is ready; a timer would). `sleep(0)` would
not do: the loop runs such wake-ups in batches before it looks at the sockets again.
"""

from __future__ import annotations

import gevent

from kestrel.service.socket_io import ClientSocket
from kestrel.storage.clock import perf_counter

# Seconds of work without waiting before a connection steps aside. A light client's round under a
# flood is about one turn of each flooder: 1 ms halved it from 2 ms, and the flood's own rate did not
# move (bench/bench_fairness.py, 2026-11-27). Read at each turn's start (not a `Final` the compiled
# build would fold in), so that a test can stretch it in either build.
TURN = 0.001


class Turns:
    """One connection's turn: it starts again whenever the connection waits for its client.

    A new turn's clock starts at its first check that finds no wait since the one before: a
    request/response client waits before each request, so its checks read no clock at all (a
    reading and its float cost about 1% of a request's instructions), and a pipelining client's
    turn starts one request after the wait that began it: a few microseconds of its 1 ms.
    """

    __slots__ = ("io", "ends")

    def __init__(self, io: ClientSocket) -> None:
        self.io = io
        self.ends = 0.0  # when the turn is over; 0: its clock has not started

    def over(self) -> bool:
        """Whether the connection has worked a whole turn since it last waited or stepped aside."""
        if self.io.waited:
            self.io.waited = False
            self.ends = 0.0
            return False
        if not self.ends:
            self.ends = perf_counter() + TURN
            return False
        return perf_counter() >= self.ends

    def pause(self) -> None:
        """Step aside if the turn is over: between requests, and between the slices of a large one."""
        if self.over():
            self.step_aside()

    def step_aside(self) -> None:
        """Let every other ready connection run, then start a new turn."""
        step_aside()
        self.ends = 0.0


def step_aside() -> None:
    """Resume once the loop has nothing else ready (also for work that is no connection's)."""
    gevent.idle()
