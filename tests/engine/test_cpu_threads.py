"""engine/cpu_threads.py: the default thread count follows the cores a process may use, a container's
CPU quota included, so the engine never runs more threads than it has cores."""

from __future__ import annotations

import os

import pytest

from engine import cpu_threads


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "400000 100000\n"}, 4.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({}, None),
])
def test_cgroup_quota_v1_and_v2(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_threads.cgroup_cpu_quota(str(tmp_path)) == quota


@pytest.mark.parametrize("quota, expected", [(None, 8), (1.5, 1), (0.5, 1), (16.0, 8), (3.0, 3)])
def test_usable_cpus_are_the_fewer_of_affinity_and_quota(monkeypatch, quota, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: quota)
    assert cpu_threads.usable_cpu_count() == expected
