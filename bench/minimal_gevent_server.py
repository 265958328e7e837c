"""A minimal memcache queue server on gevent: the floor of this server's stack, as a benchmark peer.

It answers the requests bench/loadgen.c makes of a memcache port, `set q 0 0 N` (the item joins
queue q) and `get q` (the queue's oldest item, taken), pipelined or not, with the textbook shape of
a gevent server: a `StreamServer`, a greenlet per connection, `recv` and `sendall`, a deque per
queue in a dict. It keeps no journal, no open reads, no expiry, no statistics and no limits: what it
costs an item is what Python and gevent cost on their own, which our server's figures are read
against. Not for anything but a benchmark: it trusts its client.

    .venv/bin/python -m bench.minimal_gevent_server PORT
"""

from __future__ import annotations

import argparse
from collections import defaultdict, deque

from gevent.server import StreamServer
from gevent.socket import socket

queues: defaultdict[bytes, deque[bytes]] = defaultdict(deque)


def answer(requests: bytes, replies: list[bytes]) -> bytes:
    """The replies to the whole requests at the front of `requests`, appended; what is left."""
    while True:
        end = requests.find(b"\r\n")
        if end < 0:
            return requests
        line = requests[:end]
        if line.startswith(b"get "):
            key = line[4:]
            queue = queues.get(key)
            if queue:
                item = queue.popleft()
                replies.append(b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (key, len(item), item))
            else:
                replies.append(b"END\r\n")
            requests = requests[end + 2:]
        elif line.startswith(b"set "):
            _, key, _, _, size = line.split()
            start = end + 2
            stop = start + int(size)
            if len(requests) < stop + 2:
                return requests  # the item's bytes are still to come
            queues[key].append(requests[start:stop])
            replies.append(b"STORED\r\n")
            requests = requests[stop + 2:]
        else:
            replies.append(b"ERROR\r\n")
            requests = requests[end + 2:]


def serve(connection: socket, _address: object) -> None:
    pending = b""
    while True:
        received = connection.recv(65536)
        if not received:
            return
        replies: list[bytes] = []
        pending = answer(pending + received, replies)
        if replies:
            connection.sendall(b"".join(replies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the loopback port to listen on")
    StreamServer(("127.0.0.1", parser.parse_args().port), serve).serve_forever()


if __name__ == "__main__":
    main()
