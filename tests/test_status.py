"""The status keeper: persistence, refusals and the grace period before a stricter status bites."""

from __future__ import annotations

from pathlib import Path

import gevent
import pytest

from service.status import Status, StatusKeeper
from storage.errors import Refused


def test_status_persists_and_defaults(tmp_path: Path) -> None:
    path = str(tmp_path / "status")
    keeper = StatusKeeper(path, "quiescent", 0)
    assert keeper.current == Status.QUIESCENT
    keeper.set(Status.READ_ONLY)
    assert StatusKeeper(path, "up", 0).current == Status.READ_ONLY


def test_grace_period_delays_a_stricter_status(tmp_path: Path) -> None:
    keeper = StatusKeeper(str(tmp_path / "status"), "up", 100)
    keeper.set(Status.READ_ONLY)
    assert keeper.current == Status.READ_ONLY
    keeper.check_write("put")  # still allowed during the grace period
    gevent.sleep(0.2)
    with pytest.raises(Refused, match="ReadOnly"):
        keeper.check_write("put")
    keeper.set(Status.UP)  # a looser status applies at once
    keeper.check_write("put")


def test_not_configured_refuses_changes() -> None:
    keeper = StatusKeeper(None, "up", 0)
    assert keeper.current == Status.NOT_CONFIGURED
    keeper.check_write("put")
    with pytest.raises(Refused, match="not configured"):
        keeper.set(Status.UP)


def test_unreadable_status_file_falls_back_to_the_default(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text("sideways\n")
    assert StatusKeeper(str(path), "readonly", 0).current == Status.READ_ONLY
