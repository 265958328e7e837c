"""The README's example of embedding the storage engine with plain threads, run as it is written."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from gevent._hub_local import get_hub_if_exists

README = Path(__file__).resolve().parent.parent / "README.md"


def _threads_example() -> str:
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- threads example -->\n```python\n(.*?)```", text, re.S)
    assert found, "README lost its threads example"
    return found.group(1)


def test_the_readme_threads_example_runs(tmp_path: Path) -> None:
    hubs: list[object] = []
    code = _threads_example()
    namespace: dict[str, object] = {"spool": str(tmp_path)}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README's code
    done = namespace["done"]
    assert isinstance(done, list) and sorted(done) == sorted(b"job %d" % n for n in range(100))
    check = threading.Thread(target=lambda: hubs.append(get_hub_if_exists()))
    check.start()
    check.join()
    assert hubs == [None]
    assert (tmp_path / "work").exists()  # the journal was written
