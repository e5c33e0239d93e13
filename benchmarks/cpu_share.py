"""Timing on a CPU that other people's work shares: how many cores the rest of the machine used
while we measured (the whole machine's busy time from /proc/stat less our own process tree's), and
a wait for the machine to go quiet before a measurement. Linux only; elsewhere nothing is waited
for and every measurement counts as quiet."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Snapshot:
    wall_s: float
    machine_ticks: int  # busy ticks of every CPU since boot
    tree_ticks: int  # user + system ticks of our process and every live descendant


class CpuShare:
    """`others_cores(snapshot)`: the cores used by processes outside our tree since `snapshot`."""

    def __init__(self, root_pid: int | None = None) -> None:
        self.root_pid = root_pid or os.getpid()
        self.available = os.path.exists("/proc/stat")

    def snapshot(self) -> Snapshot:
        if not self.available:
            return Snapshot(time.monotonic(), 0, 0)
        return Snapshot(time.monotonic(), _machine_busy_ticks(), _tree_ticks(self.root_pid))

    def others_cores(self, since: Snapshot) -> float:
        now = self.snapshot()
        others = (now.machine_ticks - since.machine_ticks) - (now.tree_ticks - since.tree_ticks)
        return max(0.0, others / TICKS_PER_S / max(1e-9, now.wall_s - since.wall_s))

    def wait_quiet(self, max_cores: float, window_s: float = 1.0,
                   timeout_s: float = 900.0) -> float:
        """Seconds waited until one `window_s` had others below `max_cores` (or the timeout)."""
        start = time.monotonic()
        while self.available and time.monotonic() - start < timeout_s:
            since = self.snapshot()
            time.sleep(window_s)
            if self.others_cores(since) < max_cores:
                break
        return time.monotonic() - start


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        # cpu user nice system idle iowait irq softirq steal (guest time is inside user)
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def _tree_ticks(root_pid: int) -> int:
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # NOTE: the command name may hold spaces: fields start after its closing ")"
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone since listdir
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime, stime
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack += children.get(pid, [])
    return total
