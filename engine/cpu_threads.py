"""How many threads the engine's torch ops get on the CPU by default: the cores this process may
actually run on. CPU affinity and a cgroup CPU quota (a container's `--cpus`) both count; torch's own
default sees the host's cores, and more threads than usable cores makes every parallel op wait for a
descheduled thread."""

from __future__ import annotations

import math
import os


def usable_cpu_count() -> int:
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count or 1)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None when unlimited or unknown."""
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
