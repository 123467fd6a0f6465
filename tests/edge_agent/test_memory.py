"""Memory accounting against prepared cgroup-like directories and a mocked psutil."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from edge_agent import memory
from edge_agent.memory import available_memory, cgroup_headroom, own_cgroup_dir, total_memory


def make_cgroup(tmp_path: Path, limit: str | None, current: str | None) -> Path:
    directory = tmp_path / "cg"
    directory.mkdir(exist_ok=True)
    if limit is not None:
        (directory / "memory.max").write_text(limit + "\n")
    if current is not None:
        (directory / "memory.current").write_text(current + "\n")
    return directory


@pytest.fixture
def fake_psutil(monkeypatch):
    def install(available: int, total: int = 8_000_000_000) -> None:
        monkeypatch.setattr(memory.psutil, "virtual_memory",
                            lambda: SimpleNamespace(available=available, total=total))
    return install


# ---------------------------------------------------------------------------------------------- headroom
def test_headroom_is_limit_minus_current(tmp_path):
    assert cgroup_headroom(make_cgroup(tmp_path, "1000000", "250000")) == 750000


def test_headroom_unlimited_is_none(tmp_path):
    assert cgroup_headroom(make_cgroup(tmp_path, "max", "250000")) is None


@pytest.mark.parametrize(("limit", "current"), [(None, "1"), ("1000", None), (None, None)])
def test_headroom_absent_files_is_none(tmp_path, limit, current):
    assert cgroup_headroom(make_cgroup(tmp_path, limit, current)) is None


def test_headroom_none_without_cgroup_dir(tmp_path):
    assert cgroup_headroom(None) is None
    assert cgroup_headroom(tmp_path / "does-not-exist") is None


def test_headroom_never_negative(tmp_path):
    assert cgroup_headroom(make_cgroup(tmp_path, "1000", "5000")) == 0


@pytest.mark.parametrize(("limit", "current"), [("lots", "1"), ("1000", "unknown")])
def test_headroom_unparsable_is_none(tmp_path, limit, current):
    assert cgroup_headroom(make_cgroup(tmp_path, limit, current)) is None


# ---------------------------------------------------------------------------------------------- own cgroup
def write_proc(tmp_path: Path, text: str) -> Path:
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(text)
    return proc


def test_own_cgroup_dir_of_a_service(tmp_path):
    root = tmp_path / "sys" / "fs" / "cgroup"
    proc = write_proc(tmp_path, "0::/system.slice/x.service\n")
    assert own_cgroup_dir(proc, root) == root / "system.slice" / "x.service"


def test_own_cgroup_dir_at_the_root(tmp_path):
    root = tmp_path / "cgroup"
    assert own_cgroup_dir(write_proc(tmp_path, "0::/\n"), root) == root


def test_own_cgroup_dir_picks_unified_line_in_hybrid_setup(tmp_path):
    root = tmp_path / "cgroup"
    proc = write_proc(tmp_path, "12:memory:/legacy\n1:name=systemd:/legacy\n0::/user.slice/app.scope\n")
    assert own_cgroup_dir(proc, root) == root / "user.slice" / "app.scope"


def test_own_cgroup_dir_none_for_cgroup_v1_only_or_missing_file(tmp_path):
    assert own_cgroup_dir(write_proc(tmp_path, "4:memory:/foo\n"), tmp_path) is None
    assert own_cgroup_dir(tmp_path / "absent", tmp_path) is None


def test_own_cgroup_dir_feeds_headroom(tmp_path):
    root = tmp_path / "cgroup"
    service = root / "system.slice" / "agent.service"
    service.mkdir(parents=True)
    (service / "memory.max").write_text("4096\n")
    (service / "memory.current").write_text("1024\n")
    proc = write_proc(tmp_path, "0::/system.slice/agent.service\n")
    assert cgroup_headroom(own_cgroup_dir(proc, root)) == 3072


# ---------------------------------------------------------------------------------------------- available
def test_available_is_cgroup_headroom_when_smaller(tmp_path, fake_psutil):
    fake_psutil(available=5_000_000)
    assert available_memory(None, make_cgroup(tmp_path, "1000000", "250000")) == 750000


def test_available_is_psutil_when_smaller(tmp_path, fake_psutil):
    fake_psutil(available=100_000)
    assert available_memory(None, make_cgroup(tmp_path, "1000000", "250000")) == 100_000


def test_available_is_budget_when_smallest(tmp_path, fake_psutil):
    fake_psutil(available=5_000_000)
    assert available_memory(300_000, make_cgroup(tmp_path, "1000000", "250000")) == 300_000


def test_available_with_unlimited_cgroup_and_no_budget_is_psutil(tmp_path, fake_psutil):
    fake_psutil(available=5_000_000)
    assert available_memory(None, make_cgroup(tmp_path, "max", "250000")) == 5_000_000
    assert available_memory(9_000_000, make_cgroup(tmp_path, "max", "250000")) == 5_000_000


def test_available_reads_own_cgroup_when_no_dir_given(tmp_path, fake_psutil, monkeypatch):
    fake_psutil(available=5_000_000)
    cgroup = make_cgroup(tmp_path, "2000", "500")
    monkeypatch.setattr(memory, "own_cgroup_dir", lambda: cgroup)
    assert available_memory() == 1500
    monkeypatch.setattr(memory, "own_cgroup_dir", lambda: None)
    assert available_memory() == 5_000_000


def test_total_memory_from_psutil(fake_psutil):
    fake_psutil(available=1, total=2 * 2**30)
    assert total_memory() == 2 * 2**30


def test_gpu_free_memory_is_none_without_nvml():
    assert memory.gpu_free_memory("libno-such-nvml.so.1") is None
    assert memory.gpu_free_memory("libc.so.6") is None  # a library without NVML's functions


def test_the_visible_gpu_is_the_first_of_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert memory._visible_gpu_index() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c")  # a UUID: NVML's index cannot be told from it
    assert memory._visible_gpu_index() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory._visible_gpu_index() == 0
