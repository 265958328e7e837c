"""The storage modules import one another without a cycle, read statically as a tool drawing the
import graph reads them (imports under TYPE_CHECKING count). The queue policy offers the memory
governor a small interface (`MemoryAccount`, `note_changes_to`) rather than importing it."""

from __future__ import annotations

import ast
from pathlib import Path

STORAGE = Path(__file__).resolve().parents[2] / "src" / "kestrel" / "storage"


def module_name(path: Path) -> str:
    parts = path.relative_to(STORAGE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The storage modules `path` imports (a `from package import module` names the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known} - {module_name(path), "kestrel.storage"}


def test_the_storage_modules_import_one_another_without_a_cycle() -> None:
    paths = {module_name(p): p for p in STORAGE.rglob("*.py")}
    graph = {name: imports(path, set(paths)) for name, path in paths.items()}
    assert "kestrel.storage.memory" not in graph["kestrel.storage.queue"]
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("an import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
