def scan_sets(buf: bytearray, pos: int, end: int, max_line: int, max_item: int, limit: int, /
              ) -> tuple[bytes, int, list[bytes], bytes, int] | None:
    """The run of plain sets to one key with one exptime at `pos` (src/kestrel/service/memcache/runs.py)."""

def scan_gets(buf: bytearray, pos: int, end: int, max_line: int, limit: int, /
              ) -> tuple[bytes, int, int] | None:
    """The run of plain gets of one key at `pos`."""

def values(key: bytes, datas: list[bytes], misses: int, /) -> bytes:
    """`runs.values_python`, compiled."""
