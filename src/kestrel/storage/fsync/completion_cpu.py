"""The CPU on which the disk of a path reports its finished writes, where there is one.

A disk with a single hardware queue (a SATA disk, a virtio-blk device with one queue) finishes
every request in the interrupt of that queue, on the CPU the interrupt is routed to. A group-commit
round run there is woken there; run on another CPU, each round's fdatasync ends with a wake-up
across CPUs, which cost about a tenth of the items/s under `sync_journal: always` on a 2-CPU
virtual machine (bench/README.md, "Kept: rounds on the CPU that takes the disk's completions"). A
disk with a queue per CPU (NVMe, multi-queue virtio) finishes each request on the CPU that sent
it, so any CPU will do: None.

Found from sysfs and /proc, read once: the block device of the path (the whole disk of a
partition), its one queue (`mq/`), the interrupts of the device it hangs off (`msi_irqs`, or a
single `irq`), the one that has fired most (a device's configuration interrupt hardly fires), and
that interrupt's `effective_affinity_list`, when it names one CPU this process may run on.
"""

from __future__ import annotations

import os

# How far up from a disk's device its interrupts are looked for (virtio: the PCI function is the
# parent; SCSI behind a host adapter: a few levels more).
_LEVELS_UP = 6


def completion_cpu(path: str, sys_root: str = "/sys", proc_root: str = "/proc") -> int | None:
    """The one CPU that takes the finished writes of the disk `path` is on, or None (a disk with a
    queue per CPU, a device that is not a disk, an interrupt routed to several CPUs or to one this
    process may not run on, a file that cannot be read)."""
    try:
        return _completion_cpu(path, sys_root, proc_root)
    except (OSError, ValueError):
        return None


def _completion_cpu(path: str, sys_root: str, proc_root: str) -> int | None:
    device_number = os.stat(path).st_dev
    disk = os.path.realpath(f"{sys_root}/dev/block/{os.major(device_number)}:{os.minor(device_number)}")
    if os.path.exists(os.path.join(disk, "partition")):
        disk = os.path.dirname(disk)
    if len(os.listdir(os.path.join(disk, "mq"))) != 1:
        return None
    interrupt = _busiest(_interrupts(os.path.realpath(os.path.join(disk, "device"))), proc_root)
    if interrupt is None:
        return None
    with open(f"{proc_root}/irq/{interrupt}/effective_affinity_list") as f:
        cpus = _cpu_list(f.read())
    if len(cpus) != 1 or not cpus <= os.sched_getaffinity(0):
        return None
    return cpus.pop()


def _interrupts(device: str) -> list[int]:
    """The interrupts of the device a disk hangs off: of the first of its ancestors that has any."""
    for _ in range(_LEVELS_UP):
        msi = os.path.join(device, "msi_irqs")
        if os.path.isdir(msi):
            return [int(name) for name in os.listdir(msi)]
        line = os.path.join(device, "irq")
        if os.path.isfile(line):
            with open(line) as f:
                number = int(f.read())
            return [number] if number > 0 else []
        device = os.path.dirname(device)
    return []


def _busiest(interrupts: list[int], proc_root: str) -> int | None:
    """Of `interrupts`, the one that has fired most on all CPUs together (None if none has fired)."""
    wanted = set(interrupts)
    fired: dict[int, int] = {}
    with open(f"{proc_root}/interrupts") as f:
        for line in f:
            label, _, counts = line.partition(":")
            if label.strip().isdigit() and int(label) in wanted:
                fired[int(label)] = sum(int(field) for field in counts.split() if field.isdigit())
    busiest = max(fired, key=fired.__getitem__, default=None)
    return busiest if busiest is not None and fired[busiest] > 0 else None


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("1", "0-3,6") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus
