def scan_sets(buf: bytes | bytearray, pos: int, end: int, max_line: int, max_item: int, limit: int, /
              ) -> tuple[bytes, int, list[bytes], bytes, int] | None:
    """`runs.scan_sets_python`, compiled."""

def scan_gets(buf: bytes | bytearray, pos: int, end: int, max_line: int, limit: int, /
              ) -> tuple[bytes, int, int] | None:
    """`runs.scan_gets_python`, compiled."""

def values(key: bytes, datas: list[bytes], misses: int, /) -> bytes:
    """`runs.values_python`, compiled."""
