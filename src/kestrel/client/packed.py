"""A batch of items already laid out as a put carries them, so a producer that holds its items in one
buffer (the Spark writer's Arrow columns) puts them without a Python object per item.

Thrift's `list<binary>` is each item's 4-byte big-endian length, then its bytes, end to end. A
PackedItems is that body and its count; the client frames the put around it (`put_call`), and a
short answer is offered on from the first item not taken (`packed[taken:]`), as a list would be.
"""

from __future__ import annotations

import socket
import struct

from kestrel.client.checks import BytesLike

_LENGTH = struct.Struct(">i")
_HEAD = struct.Struct(">iii3si")  # frame size, strict version | CALL, name size, "put", sequence id
_VERSION_CALL = -0x7FFEFFFF  # 0x80010001 as a signed i32: binary protocol version 1, message type CALL
_LIST_OF_BINARY = b"\x0f\x00\x02\x0b"  # field 2 `items`: a list whose elements are binary (type 11)


class PackedItems:
    """`count` items laid end to end in `body`, each a 4-byte big-endian length then its bytes.

    The layout is the caller's to get right (the Spark writer builds it from an Arrow column, and
    its tests hold it to thriftpy2's own encoding); the count is checked against the body's size
    only when items are skipped (`[taken:]`), a path taken on short answers alone.
    """

    __slots__ = ("body", "count")

    def __init__(self, body: BytesLike, count: int) -> None:
        self.body = memoryview(body).cast("B")
        self.count = count

    def __len__(self) -> int:
        return self.count

    def first_size(self) -> int:
        """The bytes of the first item (there must be one)."""
        return int(_LENGTH.unpack_from(self.body, 0)[0])

    def __getitem__(self, rest: slice) -> PackedItems:
        """The items from `rest.start` on (only `[first:]` is supported: what a short answer leaves)."""
        if rest.stop is not None or rest.step is not None:
            raise ValueError("PackedItems can only be cut as [first:]")
        first = min(max(rest.start or 0, 0), self.count)
        if first == self.count:
            return PackedItems(b"", 0)  # all taken, the usual answer: nothing to walk
        at = 0
        try:
            for _ in range(first):
                at += 4 + _LENGTH.unpack_from(self.body, at)[0]
        except struct.error:
            at = len(self.body) + 1
        if at > len(self.body):
            raise ValueError(f"PackedItems: {len(self.body)} bytes do not hold {self.count} items")
        return PackedItems(self.body[at:], self.count - first)

    def put_call(self, queue: str, expiration_ms: int) -> list[BytesLike]:
        """The framed binary Thrift call `put(queue, items, expiration_ms)`, sequence id 0 (as thriftpy2
        sends it), in parts to be sent in turn: the items' bytes are not copied into one."""
        name = queue.encode()
        size = _HEAD.size - 4 + 7 + len(name) + 8 + len(self.body) + 8
        return [b"".join([_HEAD.pack(size, _VERSION_CALL, 3, b"put", 0),
                          b"\x0b\x00\x01", _LENGTH.pack(len(name)), name,  # field 1, a string: the queue
                          _LIST_OF_BINARY, _LENGTH.pack(self.count)]),
                self.body,
                b"\x08\x00\x03" + _LENGTH.pack(expiration_ms) + b"\x00"]  # field 3, an i32; the end


def send_parts(sock: socket.socket, parts: list[BytesLike]) -> None:
    """Send `parts` one after the other, gathered by the kernel (no joined copy), however few bytes
    each send takes."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
