"""The CPU that takes a disk's finished writes, read from sysfs and /proc: here from trees made to
look like them (a virtio disk with one queue, a SATA disk behind its adapter, a disk with a queue
per CPU), and from this machine's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kestrel.storage.fsync.completion_cpu import completion_cpu

CPU = min(os.sched_getaffinity(0))  # a CPU these tests may run on


def fake_disk(root: Path, on: Path, *, queues: int = 1, partition: bool = False,
              fired: dict[int, list[int]] | None = None, routed: str = str(CPU),
              legacy_irq: int | None = None) -> tuple[str, str]:
    """A sysfs and a /proc under `root` in which the file system of `on` is a disk (or a partition
    of one) with `queues` hardware queues, hanging off a PCI function whose interrupts have `fired`
    so many times on each CPU (the busiest routed to `routed`), or off an adapter a few levels up
    with a single `legacy_irq`. Their roots."""
    sys_root, proc_root = root / "sys", root / "proc"
    function = sys_root / "devices/pci0000:00/0000:00:02.0"
    device = function / "virtio1" if legacy_irq is None else function / "ata1/host0/target0:0:0/0:0:0:0"
    disk = device / "block/vda"
    for queue in range(queues):
        (disk / "mq" / str(queue)).mkdir(parents=True)
    (disk / "device").symlink_to(device)
    block = disk
    if partition:
        block = disk / "vda1"
        block.mkdir()
        (block / "partition").write_text("1\n")
    number = os.stat(on).st_dev
    (sys_root / "dev/block").mkdir(parents=True)
    (sys_root / "dev/block" / f"{os.major(number)}:{os.minor(number)}").symlink_to(block)
    fired = fired if fired is not None else {35: [1, 0], 36: [0, 120_000]}
    if legacy_irq is None:
        (function / "msi_irqs").mkdir()
        for interrupt in fired:
            (function / "msi_irqs" / str(interrupt)).write_text("msix\n")
    else:
        (function / "irq").write_text(f"{legacy_irq}\n")
    lines = ["           CPU0       CPU1"]
    lines += [f" {interrupt}: {'  '.join(map(str, counts))}  PCI-MSIX-0000:00:02.0  {interrupt}-edge  virtio1"
              for interrupt, counts in fired.items()]
    lines.append("NMI:          0          0   Non-maskable interrupts")
    proc_root.mkdir()
    (proc_root / "interrupts").write_text("\n".join(lines) + "\n")
    busiest = max(fired, key=lambda interrupt: sum(fired[interrupt]))
    for interrupt in fired:
        (proc_root / "irq" / str(interrupt)).mkdir(parents=True)
        (proc_root / "irq" / str(interrupt) / "effective_affinity_list").write_text(
            (routed if interrupt == busiest else "0-1") + "\n")
    return str(sys_root), str(proc_root)


def test_a_disk_with_one_queue_finishes_on_the_cpu_its_busiest_interrupt_goes_to(tmp_path: Path) -> None:
    """The request interrupt, not the configuration one beside it (routed to two CPUs here)."""
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path)) == CPU


def test_a_partition_is_found_through_its_disk(tmp_path: Path) -> None:
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, partition=True)) == CPU


def test_a_disk_behind_an_adapter_with_one_interrupt_line(tmp_path: Path) -> None:
    found = completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, fired={19: [5, 7]}, legacy_irq=19))
    assert found == CPU


def test_a_disk_with_a_queue_per_cpu_finishes_where_each_write_was_sent(tmp_path: Path) -> None:
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, queues=2)) is None


def test_an_interrupt_routed_to_several_cpus_names_none(tmp_path: Path) -> None:
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, routed="0-1")) is None


def test_a_cpu_this_process_may_not_run_on_is_not_named(tmp_path: Path) -> None:
    elsewhere = str(max(os.sched_getaffinity(0)) + 1)
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, routed=elsewhere)) is None


def test_interrupts_that_never_fired_name_none(tmp_path: Path) -> None:
    assert completion_cpu(str(tmp_path), *fake_disk(tmp_path, tmp_path, fired={35: [0, 0], 36: [0, 0]})) is None


def test_a_file_system_on_no_disk_names_none(tmp_path: Path) -> None:
    """tmpfs, overlay, a path gone: no block device under /sys/dev/block to follow."""
    (tmp_path / "sys").mkdir()
    assert completion_cpu(str(tmp_path), str(tmp_path / "sys"), str(tmp_path)) is None
    assert completion_cpu(str(tmp_path / "gone")) is None


@pytest.mark.skipif(not os.path.isdir("/sys/dev/block"), reason="no sysfs here")
def test_this_machines_disk_names_a_cpu_this_process_may_run_on_or_none(tmp_path: Path) -> None:
    found = completion_cpu(str(tmp_path))
    assert found is None or found in os.sched_getaffinity(0)
