"""The cores a process may use: affinity capped by the cgroup quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common import cores
from common.cores import available_cores, cgroup_cpu_limit


def _cgroup(root: Path, path: str, cpu_max: str | None) -> None:
    directory = root / path.strip("/")
    directory.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (directory / "cpu.max").write_text(cpu_max + "\n")


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    _cgroup(tmp_path, "/", None)
    _cgroup(tmp_path, "/system.slice", "300000 100000")
    _cgroup(tmp_path, "/system.slice/fedfit-agent.service", "max 100000")
    assert cgroup_cpu_limit(tmp_path, "/system.slice/fedfit-agent.service") == 3.0
    _cgroup(tmp_path, "/system.slice/fedfit-agent.service", "150000 100000")
    assert cgroup_cpu_limit(tmp_path, "/system.slice/fedfit-agent.service") == 1.5


def test_no_quota_is_no_limit(tmp_path: Path) -> None:
    _cgroup(tmp_path, "/a/b", "max 100000")
    assert cgroup_cpu_limit(tmp_path, "/a/b") is None
    assert cgroup_cpu_limit(tmp_path, "/not/there") is None
    (tmp_path / "a" / "b" / "cpu.max").write_text("garbage")
    assert cgroup_cpu_limit(tmp_path, "/a/b") is None


def test_available_cores_is_the_affinity_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: None)
    assert available_cores() == affinity
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: 0.5)  # a half-core quota still runs one thread
    assert available_cores() == 1
    monkeypatch.setattr(cores, "cgroup_cpu_limit", lambda: affinity + 10.0)  # a quota above the cores we have
    assert available_cores() == affinity
