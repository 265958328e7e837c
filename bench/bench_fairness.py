"""How long a light client waits while other clients keep the server busy, beside Redis.

Each scenario runs against our server and against Redis, in the same run, each on a server started
afresh for it (after a flood, a server is still answering the flooders' buffered requests for a
while); a light client makes one request at a time and its round times are reported (p50, p99,
max, in ms):

- flood: FLOODERS clients pipeline requests as fast as the server answers them (memcache
  `get` of an empty queue, Thrift `get_version`; Redis `GET` of a missing key);
- accepts: CONNECTIONS clients connect at once; the light client's first round behind them;
- big get: one client takes 100,000 items in one request (Thrift `get`; Redis `LPOP key 100000`).

The clients are threads of this process (the big get's taker a process), so every figure includes
the client's own time; Redis, measured the same way, shows what that costs.

Then hostile neighbours (`--only neighbours`, bench/hostile.py): a light client's put + get rounds
(Thrift in the server's protocol and transport, and memcache) while another client, in a process of
its own, sends in a loop what the limits let through at its largest, each beside the same light
client on the same server with no neighbour, measured first, and the server's CPU meanwhile (% of a
core, from /proc):

- Thrift, on a server of each protocol and transport: `get_version` calls carrying, in a field the
  contract lacks, max_batch_items elements (empty structs, i64s, strings filling max_frame_size, a
  map of lists, lists nested MAX_DEPTH deep) or MAX_FIELDS fields, in turn;
- memcache: `get` lines of max_line_length bytes; a set of an item of max_frame_size bytes and its get;
- connections dropped mid-request, again and again (half a Thrift frame, half a memcache set).

And what the loop is held for at most by one of those Thrift frames, without sockets (`--only
reading`): each read by this process's build of the server's readers (`PYTHONPATH=build/compiled`
for the compiled one), best of 3, in thread CPU time: the whole message, and the longest stretch
between two of the pauses the reader offers the connection (every PAUSE_EVERY values), where a
connection whose turn is over steps aside.

    .venv/bin/python -m bench.bench_fairness [--rounds 300] [--flooders 10] [--connections 5000]
        [--only flood neighbours reading] [--build pure|compiled] [--source DIR]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import resource
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import hostile, peers
from bench.common import load_average, machine, process_cpu_seconds
from kestrel.build import build_name
from kestrel.service.thrift.messages import METHODS, read_args
from kestrel.service.thrift.protocol import PROTOCOLS, Reader
from tests.support.flood import LIGHT_TIMEOUT, Flooder, Light
from tests.support.thrift_wire import encode_call, framed, recv_exactly


def summary(times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):7.2f}  p99 {p99:7.2f}  max {ms[-1]:7.2f}"


def flood(port: int, flood_request: bytes, light: Callable[[], Light], flooders: int, rounds: int) -> str:
    client = light()
    crowd = [Flooder(port, flood_request) for _ in range(flooders)]
    try:
        time.sleep(0.5)  # the flood is under way
        times = []
        for _ in range(rounds):
            try:
                times.append(client.round())
            except TimeoutError:
                return f"starved: no reply within {LIGHT_TIMEOUT:.0f} s after {len(times)} rounds"
            time.sleep(0.002)
        return summary(times)
    finally:
        for f in crowd:
            f.stop()
        client.close()


def accepts(port: int, light: Callable[[], Light], connections: int) -> str:
    client = light()
    client.round()
    crowd = [socket.socket() for _ in range(connections)]
    try:
        for s in crowd:
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
        return summary([client.round()])
    finally:
        for s in crowd:
            s.close()
        client.close()


def big_get(take: Callable[[], None], light: Callable[[], Light]) -> str:
    """The taker is a process of its own: as a thread, reading 100,000 items in Python held this
    process's interpreter lock, and the light client measured that wait instead of the server's."""
    client = light()
    times: list[float] = []
    taker = multiprocessing.get_context("fork").Process(target=take)
    taker.start()
    while taker.is_alive():
        times.append(client.round())
    taker.join()
    client.close()
    if taker.exitcode != 0:
        raise RuntimeError(f"the taker exited with {taker.exitcode}")
    return summary(times) + f"  ({len(times)} rounds during the get)"


ITEMS = 100_000


def kestrel_fill_and_take(port: int) -> Callable[[], None]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for start in range(0, ITEMS, 10_000):
            s.sendall(framed(encode_call("binary", "put", queue_name="big",
                                         items=[b"%09d" % n for n in range(start, start + 10_000)],
                                         expiration_msec=0)))
            (size,) = struct.unpack("!i", recv_exactly(s, 4))
            recv_exactly(s, size)

    def take() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(framed(encode_call("binary", "get", queue_name="big", max_items=ITEMS, timeout_msec=0,
                                         auto_abort_msec=0)))
            (size,) = struct.unpack("!i", recv_exactly(s, 4))
            recv_exactly(s, size)
    return take


def redis_fill_and_take(port: int) -> Callable[[], None]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for start in range(0, ITEMS, 10_000):
            args = [b"RPUSH", b"big", *(b"%09d" % n for n in range(start, start + 10_000))]
            s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
            data = b""
            while not data.endswith(b"\r\n"):
                data += s.recv(100)

    def take() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"LPOP big %d\r\n" % ITEMS)
            data = bytearray()
            while data.count(b"\r\n") < 2 * ITEMS + 1:
                data += s.recv(1 << 20)
    return take


def light_rounds(make: Callable[[], hostile.ThriftLight | hostile.MemcacheLight], rounds: int) -> list[float]:
    client = make()
    try:
        client.round()  # the queue made
        times = []
        for _ in range(rounds):
            times.append(client.round())
            time.sleep(0.002)
        return times
    finally:
        client.close()


def beside(k: peers.Running, protocol: str, transport: str, run: Callable[[], None] | None,
           rounds: int) -> str:
    """Thrift's and memcache's light rounds, one client after the other, with `run` beside them;
    the server's CPU meanwhile as % of a core."""
    with hostile.neighbour(run):
        cpu, started = process_cpu_seconds(k.pid), time.perf_counter()
        thrift = light_rounds(lambda: hostile.ThriftLight(k["thrift"], protocol, transport), rounds)
        memcache = light_rounds(lambda: hostile.MemcacheLight(k["memcache"]), rounds)
        busy = (process_cpu_seconds(k.pid) - cpu) / (time.perf_counter() - started)
    return f"{summary(thrift)} | {summary(memcache)} | {busy * 100:3.0f}%"


def neighbours(work: Path, rounds: int, build: str, source: Path | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for transport in ("framed", "buffered"):
        for protocol in ("binary", "compact"):
            setting = f"{protocol} {transport}"
            frames = list(hostile.thrift_frames(protocol).values())
            with peers.kestrel(work, build=build, source=source,
                               settings={"thrift_protocol": protocol, "thrift_transport": transport}) as k:
                largest = hostile.send_thrift(k["thrift"], protocol, transport, frames)
                cut = hostile.drop_mid_frame(k["thrift"], hostile.thrift_cut(protocol, transport))
                for name, run in (("alone", None), ("largest frames", largest), ("connections cut", cut)):
                    rows.append((f"{setting}: {name}", beside(k, protocol, transport, run, rounds)))
            if (protocol, transport) == ("binary", "framed"):
                with peers.kestrel(work, build=build, source=source) as k:
                    rows.append(("memcache: alone", beside(k, protocol, transport, None, rounds)))
                    for name, run in (("memcache: longest lines", hostile.memcache_lines(k["memcache"])),
                                      ("memcache: largest items", hostile.memcache_values(k["memcache"])),
                                      ("memcache: connections cut",
                                       hostile.drop_mid_frame(k["memcache"], hostile.MEMCACHE_CUT))):
                        rows.append((name, beside(k, protocol, transport, run, rounds)))
    return rows


def paused_reading(reader_cls: type[Reader], message: bytes) -> list[float]:
    """The thread's CPU time at the start of reading `message`, at each pause offered, at the end."""
    marks = [time.thread_time()]
    reader = reader_cls(message, len(message), len(message), hostile.MAX_ITEMS, hostile.MAX_BYTES,
                        pause=lambda: marks.append(time.thread_time()))
    name, _, _ = reader.read_message_begin()
    read_args(reader, METHODS[name])
    marks.append(time.thread_time())
    return marks


def reading() -> list[tuple[str, str]]:
    rows = []
    for protocol in ("binary", "compact"):
        reader_cls = PROTOCOLS[protocol][0]
        for kind, message in hostile.thrift_frames(protocol).items():
            whole, stretch = [], []
            for _ in range(3):
                marks = paused_reading(reader_cls, message)
                whole.append(marks[-1] - marks[0])
                stretch.append(max(b - a for a, b in itertools.pairwise(marks)))
            rows.append((f"{protocol}: {kind}", f"{min(whole) * 1000:8.2f} {min(stretch) * 1000:8.3f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--flooders", type=int, default=10)
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--only", nargs="+", choices=("flood", "neighbours", "reading"),
                        default=("flood", "neighbours", "reading"))
    parser.add_argument("--build", choices=("pure", "compiled"), default="pure",
                        help="our server's build for the neighbours")
    parser.add_argument("--source", type=Path, help="run our server from this tree (another version's src/ "
                        "or build/compiled) for the neighbours")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers started here inherit it

    print(f"light client round times in ms; {machine()}; load average {load_average()}")
    if "neighbours" in args.only:
        with tempfile.TemporaryDirectory() as work:
            rows = neighbours(Path(work), args.rounds, args.build, args.source)
        print(f"{'beside a hostile client':<36} {'thrift put + get':<38} | {'memcache set + get':<38} "
              f"| server CPU")
        for name, figures in rows:
            print(f"{name:<36} {figures}")
        print(f"load average {load_average()}")
    if "reading" in args.only:
        print(f"one Thrift frame read without sockets ({build_name()} build), CPU ms: whole message, "
              f"longest stretch between pauses")
        for name, figures in reading():
            print(f"{name:<36} {figures}")
    if "flood" in args.only:
        flood_scenarios(args)


def flood_scenarios(args: argparse.Namespace) -> None:
    version = framed(encode_call("binary", "get_version"))
    with tempfile.TemporaryDirectory() as work:
        def ours(scenario: Callable[[peers.Running], str]) -> str:
            """A scenario on a server of its own: one that came after a flood on the same server
            would also measure the server finishing the flood's buffered requests."""
            with peers.kestrel(Path(work)) as k:
                return scenario(k)

        def redis(scenario: Callable[[int], str]) -> str:
            with peers.redis(Path(work)) as r:
                return scenario(r["redis"])

        def mc_light(k: peers.Running) -> Callable[[], Light]:
            return lambda: Light(k["memcache"], b"get none\r\n", b"END\r\n")

        def thrift_light(k: peers.Running) -> Callable[[], Light]:
            return lambda: Light(k["thrift"], version, b"", framed_reply=True)

        def redis_light(port: int) -> Callable[[], Light]:
            return lambda: Light(port, b"GET none\r\n", b"$-1\r\n")

        n, rounds = args.flooders, args.rounds
        rows: list[tuple[str, str]] = [
            (f"memcache, {n} pipelining",
             ours(lambda k: flood(k["memcache"], b"get none\r\n", mc_light(k), n, rounds))),
            (f"thrift, {n} pipelining",
             ours(lambda k: flood(k["thrift"], version, thrift_light(k), n, rounds))),
            (f"memcache, {args.connections} connecting",
             ours(lambda k: accepts(k["memcache"], mc_light(k), args.connections))),
            ("thrift, a get of 100,000 items",
             ours(lambda k: big_get(kestrel_fill_and_take(k["thrift"]), thrift_light(k)))),
            (f"redis, {n} pipelining",
             redis(lambda port: flood(port, b"GET none\r\n", redis_light(port), n, rounds))),
            (f"redis, {args.connections} connecting",
             redis(lambda port: accepts(port, redis_light(port), args.connections))),
            ("redis, LPOP of 100,000 items",
             redis(lambda port: big_get(redis_fill_and_take(port), redis_light(port)))),
        ]
    for name, figures in rows:
        print(f"{name:<36} {figures}")


if __name__ == "__main__":
    main()
