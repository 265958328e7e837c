"""A greenlet is never handed its function's arguments through gevent: they are bound into the
callable it runs (`functools.partial`).

gevent's `kill` drops a greenlet's `args` at once, even while the greenlet runs, and its `run` passes
them on without a reference of its own. Compiled code borrows its arguments from its caller, so a
compiled function that goes on after the kill (a put whose large write the runtime lets finish)
reads freed objects. A bound callable is held by the greenlet until it ends, and so are its
arguments.
"""

from __future__ import annotations

import ast
import weakref
from functools import partial

import gevent

from tests.conftest import ROOT
from tests.project.test_repository import tracked_files

# The calls that make a greenlet (or a thread pool's task) run a callable: `spawn_later` takes the
# delay first.
SPAWNS = {"spawn": 1, "spawn_raw": 1, "spawn_later": 2, "Greenlet": 1}
# The one call that hands arguments on purpose, to show what the rule guards against.
ON_PURPOSE = "# handed on purpose"


def test_gevent_drops_the_arguments_of_a_running_greenlet_it_kills() -> None:
    """Why the rule exists; should a later gevent keep them, the rule costs nothing and stays."""
    greenlet = gevent.spawn(gevent.sleep, 5, b"a value")  # handed on purpose
    gevent.sleep(0)
    assert greenlet.args == (5, b"a value")
    greenlet.kill(block=False)
    assert greenlet.args == ()
    greenlet.join(5)


def test_a_bound_callable_is_held_until_its_killed_greenlet_ends() -> None:
    """What compiled code needs of the rule: the partial, whose arguments it borrows, lives on
    through the kill (gevent drops the greenlet's own reference to it, but its `run` holds one)."""
    resumed: list[bool] = []

    def wait(held: list[bytes]) -> None:
        try:
            gevent.sleep(5)
        finally:
            resumed.append(held == [b"item"])  # used after the kill, as a finishing write's caller does

    bound = partial(wait, [b"item"])
    alive = weakref.ref(bound)
    greenlet = gevent.spawn(bound)
    del bound
    gevent.sleep(0)
    assert not greenlet.dead
    greenlet.kill(block=False)
    assert alive() is not None
    greenlet.join(5)
    assert resumed == [True] and alive() is None


def handed_arguments(source: str, name: str) -> list[str]:
    """The calls in `source` that hand a greenlet (or a pool's task) arguments beside its callable."""
    handed = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        called_name = (called.attr if isinstance(called, ast.Attribute)
                       else called.id if isinstance(called, ast.Name) else "")
        takes = SPAWNS.get(called_name)
        if takes is None or ON_PURPOSE in lines[node.lineno - 1]:
            continue
        if (len(node.args) > takes or node.keywords
                or any(isinstance(arg, ast.Starred) for arg in node.args)):
            handed.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return handed


def test_the_scan_finds_arguments_handed_to_a_greenlet() -> None:
    source = ("gevent.spawn(coll.put, 'q', [b'item'])\n"
              "pool.spawn(partial(work, sock))\n"
              "gevent.spawn_later(0.1, partial(client.sendall, b'x'))\n"
              "gevent.spawn_later(0.1, client.sendall, b'x')\n"
              "gevent.spawn(session.get, timeout_ms=500)\n"
              "gevent.spawn(*call)\n"
              "gevent.spawn(gevent.sleep, 5)  # handed on purpose\n")
    assert [line.split(":")[1] for line in handed_arguments(source, "f.py")] == ["1", "4", "5", "6"]


def test_no_greenlet_is_handed_its_arguments() -> None:
    handed = [call for name in tracked_files()
              if name.endswith(".py") and not name.startswith("tests/_generated")
              for call in handed_arguments((ROOT / name).read_text(encoding="utf-8"), name)]
    assert handed == [], "bind the arguments with functools.partial:\n" + "\n".join(handed)
