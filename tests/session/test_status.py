"""The status keeper: persistence, refusals and the grace period before a stricter status bites."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from kestrel.service.session.status import Status, StatusChangePending, StatusKeeper, UnknownStatus
from kestrel.storage.errors import KestrelError, RefusedByStatus
from kestrel.storage.runtime import ManualRuntime
from tests.support.power_loss import Disk


def test_status_persists_and_defaults(tmp_path: Path) -> None:
    path = str(tmp_path / "status")
    keeper = StatusKeeper(path, Status.QUIESCENT, 0)
    assert keeper.current == Status.QUIESCENT
    keeper.set(Status.READ_ONLY)
    assert StatusKeeper(path, Status.UP, 0).current == Status.READ_ONLY


def test_a_status_set_survives_a_power_cut_and_one_that_cannot_be_written_is_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "status"
    keeper = StatusKeeper(str(path), Status.UP, 0)
    with Disk(tmp_path) as disk:
        keeper.set(Status.READ_ONLY)
        disk.power_cut(str(tmp_path))  # what no fsync covered is lost
    assert StatusKeeper(str(path), Status.UP, 0).current == Status.READ_ONLY

    path.unlink()
    path.mkdir()  # the file cannot be replaced now
    with pytest.raises(KestrelError, match=f"cannot write the status file {path}: .*; the status stays ReadOnly"):
        keeper.set(Status.QUIESCENT)
    assert keeper.current == keeper.enforced == Status.READ_ONLY
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status"]  # no temporary left


def test_grace_period_delays_a_stricter_status(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    keeper = StatusKeeper(str(tmp_path / "status"), Status.UP, 50_000, runtime)
    keeper.set(Status.READ_ONLY)
    assert keeper.current == Status.READ_ONLY
    runtime.advance(49_999)
    keeper.check_write("put")  # still allowed during the grace period
    with pytest.raises(StatusChangePending, match=r"\(1 ms left\)"):
        keeper.set(Status.QUIESCENT)
    runtime.advance(1)
    with pytest.raises(RefusedByStatus, match="ReadOnly"):
        keeper.check_write("put")
    keeper.set(Status.UP)  # a looser status applies at once
    keeper.check_write("put")


@pytest.mark.parametrize(("status", "writes", "reads"), [
    (Status.UP, True, True), (Status.READ_ONLY, False, True), (Status.QUIESCENT, False, False)])
def test_the_checks_follow_the_status_set_and_the_one_read_at_start(tmp_path: Path, status: Status, writes: bool,
                                                                      reads: bool) -> None:
    def allowed(keeper: StatusKeeper) -> tuple[bool, bool]:
        answers = []
        for check in (keeper.check_write, keeper.check_read):
            try:
                check("put")
                answers.append(True)
            except RefusedByStatus:
                answers.append(False)
        return answers[0], answers[1]

    path = str(tmp_path / "status")
    keeper = StatusKeeper(path, Status.UP, 0)
    keeper.set(status)
    assert allowed(keeper) == (writes, reads)
    assert allowed(StatusKeeper(path, Status.UP, 0)) == (writes, reads)  # read from the file at start
    assert allowed(StatusKeeper(None, status, 0)) == (True, True)  # not configured: nothing refused


def test_a_change_during_a_pending_grace_period_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "status"
    keeper = StatusKeeper(str(path), Status.UP, 60_000, ManualRuntime())  # its grace timer off the hub
    keeper.set(Status.READ_ONLY)
    keeper.set(Status.READ_ONLY)  # the same change again is no change
    for status in (Status.QUIESCENT, Status.UP):
        with pytest.raises(StatusChangePending, match=r"from Up to ReadOnly is still in its grace period"):
            keeper.set(status)
    assert keeper.current == Status.READ_ONLY and path.read_text() == "ReadOnly\n"
    keeper.check_write("put")  # Up is still enforced: the refused change did not cut the grace short


@pytest.mark.parametrize("given, expected", [
    ("up", Status.UP), ("ReadOnly", Status.READ_ONLY), ("read_only", Status.READ_ONLY),
    ("read-only", Status.READ_ONLY), (" QUIESCENT\n", Status.QUIESCENT), (3, Status.UP), (1, Status.QUIESCENT),
])
def test_status_parse_reads_names_and_thrift_numbers(given: str | int, expected: Status) -> None:
    assert Status.parse(given) == expected


@pytest.mark.parametrize("given", ["sideways", "", "upp", 7, -1, True])
def test_status_parse_names_what_was_wrong(given: str | int) -> None:
    with pytest.raises(UnknownStatus, match=r"unknown status .* \(expected up, readonly or quiescent\)"):
        Status.parse(given)


def test_not_configured_refuses_changes() -> None:
    keeper = StatusKeeper(None, Status.UP, 0)
    assert keeper.current == Status.NOT_CONFIGURED
    keeper.check_write("put")
    with pytest.raises(RefusedByStatus, match="not configured"):
        keeper.set(Status.UP)


def test_unreadable_status_file_falls_back_to_the_default(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text("sideways\n")
    assert StatusKeeper(str(path), Status.READ_ONLY, 0).current == Status.READ_ONLY


def test_a_pending_change_is_refused_over_thrift_and_memcache(server_factory: Any) -> None:
    from thriftpy2.thrift import TApplicationException

    from kestrel.contract import kestrel_thrift
    from tests.server.test_shutdown import _thrift_client

    srv = server_factory({"status_change_grace_period": "1min"})
    thrift = _thrift_client(srv.thrift_port)
    mc = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        thrift.set_status(kestrel_thrift.Status.READ_ONLY)
        with pytest.raises(TApplicationException, match="still in its grace period"):
            thrift.set_status(kestrel_thrift.Status.QUIESCENT)
        mc.sendall(b"status up\r\n")
        assert mc.recv(200).startswith(b"CLIENT_ERROR cannot change the status to Up")  # a refused request
        assert thrift.current_status() == kestrel_thrift.Status.READ_ONLY
        assert thrift.put("still", [b"taken"], 0) == 1  # Up is enforced until the grace period ends
    finally:
        thrift.close()
        mc.close()
