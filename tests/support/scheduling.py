"""Where and in which order tests run under pytest-xdist (`make test`: `pytest -n N --dist loadgroup`).

Tests sharing a fixture of this project that outlives one test run in one process, so that it is
set up once there (and tests marked `xdist_group(name)` run together): a module's shared server
serves that module's tests, one ZooKeeper serves every test that needs one. No test measures how fast
something is (bench/ does), so none needs the machine to itself. Spark is the exception: its tests would take minutes in one process, so they
are dealt out to a few groups, each with its own SparkSession.

Work units run longest first, so that no long test ends the run alone: by the durations of the
previous run (kept in pytest's cache), and on a fresh clone tests marked `slow` and shared-fixture
groups first.
"""

from __future__ import annotations

import heapq
from typing import Any

import pytest

DURATIONS_KEY = "kestrel/durations"
DEALT_OUT = {"spark"}  # session fixtures whose tests are spread over a few processes, not one
GUESS_SECONDS = 0.5  # a test not seen before
GUESS_SLOW_SECONDS = 10.0  # a test marked `slow` not seen before
SCOPE_RANK = {"class": 1, "module": 2, "package": 3, "session": 4}


def plain_nodeid(nodeid: str) -> str:
    """A node id without the `@group` suffix xdist's loadgroup gives it."""
    at, bracket = nodeid.rfind("@"), nodeid.rfind("]")
    return nodeid[:at] if at > bracket else nodeid


def shared_fixture(item: pytest.Item) -> tuple[str, str] | None:
    """(scope, name) of the widest fixture defined under tests/ that `item` uses and that outlives it."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    widest: tuple[int, str, str] | None = None
    for name in sorted(item.fixturenames):  # type: ignore[attr-defined]
        definitions = info.name2fixturedefs.get(name)
        if not definitions:
            continue
        definition = definitions[-1]
        rank = SCOPE_RANK.get(definition.scope, 0)
        if rank and definition.func.__module__.startswith("tests.") and (widest is None or rank > widest[0]):
            widest = (rank, definition.scope, name)
    return None if widest is None else (widest[1], widest[2])


def estimate(item: pytest.Item, durations: dict[str, float]) -> float:
    known = durations.get(plain_nodeid(item.nodeid))
    if known is not None:
        return known
    return GUESS_SLOW_SECONDS if item.get_closest_marker("slow") else GUESS_SECONDS


def deal_out(items: list[pytest.Item], hands: int, durations: dict[str, float]) -> list[list[pytest.Item]]:
    """Split `items` in `hands` groups of about equal time: longest first to the least loaded group."""
    heap = [(0.0, i) for i in range(hands)]
    groups: list[list[pytest.Item]] = [[] for _ in range(hands)]
    for item in sorted(items, key=lambda it: -estimate(it, durations)):
        load, i = heapq.heappop(heap)
        groups[i].append(item)
        heapq.heappush(heap, (load + estimate(item, durations), i))
    order = {id(item): n for n, item in enumerate(items)}
    return [sorted(g, key=lambda it: order[id(it)]) for g in groups if g]


class Scheduler:
    """Groups and orders the tests in each xdist worker; records durations in the controller."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seen: dict[str, float] = {}

    def durations(self) -> dict[str, float]:
        cache = getattr(self.config, "cache", None)
        return dict(cache.get(DURATIONS_KEY, {})) if cache is not None else {}

    @pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Group the tests that share a fixture, and order the groups and lone tests longest first."""
        workerinput: dict[str, Any] | None = getattr(self.config, "workerinput", None)
        if workerinput is None:
            return  # a plain run keeps the files' order
        durations = self.durations()
        units: dict[str, list[pytest.Item]] = {}
        dealt: dict[str, list[pytest.Item]] = {}
        for item in items:
            shared = shared_fixture(item)
            named = item.get_closest_marker("xdist_group")
            if named is not None:  # a group a test module asks for
                units.setdefault(str(named.args[0]), []).append(item)
            elif shared is None:
                units[item.nodeid] = [item]
            elif shared[0] == "session" and shared[1] in DEALT_OUT:
                dealt.setdefault(shared[1], []).append(item)
            else:
                key = shared[1] if shared[0] == "session" else item.nodeid.split("::")[0]
                units.setdefault(key, []).append(item)
        hands = max(1, int(workerinput["workercount"]) // 2)
        for name, members in dealt.items():
            for n, group in enumerate(deal_out(members, hands, durations)):
                units[f"{name}-{n}"] = group
        ordered = sorted(units.items(), key=lambda unit: -sum(estimate(it, durations) for it in unit[1]))
        for key, members in ordered:
            if len(members) > 1:
                for item in members:
                    item.add_marker(pytest.mark.xdist_group(key))
        items[:] = [item for _, members in ordered for item in members]

    @pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)  # after xdist's own
    def pytest_collection_modifyitems_group_ids(self, items: list[pytest.Item]) -> None:
        """xdist's loadgroup names an item's group by appending `@group` to `item._nodeid`, which
        pytest 9.2 no longer reads (the node id now lives in `item._id`): append it there."""
        if not getattr(self.config.option, "loadgroup", False):
            return
        from _pytest.nodeid import coerce_node_id

        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark is not None and "@" not in item.nodeid and hasattr(item, "_id"):
                item._id = coerce_node_id(f"{item.nodeid}@{mark.args[0]}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(self.config, "workerinput", None) is None:
            nodeid = plain_nodeid(report.nodeid)
            self.seen[nodeid] = self.seen.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is not None and self.seen and getattr(self.config, "workerinput", None) is None:
            cache.set(DURATIONS_KEY, {**self.durations(), **{k: round(v, 2) for k, v in self.seen.items()}})
