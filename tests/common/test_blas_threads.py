"""Unit tests of common.blas_threads: which cores and BLAS libraries get one BLAS thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import blas_threads

PI4_FEATURES = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU part\t: 0xd08\n"
GRACE_FEATURES = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve\n"
NVPL_MAPS = ("ffff0000-ffff1000 r-xp 00000000 08:01 42 /venv/torch/lib/libnvpl_blas_lp64_gomp.so.0\n"
             "ffff2000-ffff3000 r-xp 00000000 08:01 43 /venv/torch/lib/libtorch_cpu.so\n")
OPENBLAS_MAPS = "ffff0000-ffff1000 r-xp 00000000 08:01 42 /venv/numpy.libs/libopenblas64_p-r0.so\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("machine", "cpuinfo", "lacks"), [
    ("aarch64", PI4_FEATURES, True),
    ("aarch64", GRACE_FEATURES, False),
    ("aarch64", "processor\t: 0\n", False),  # no Features line: unknown, left alone
    ("x86_64", PI4_FEATURES, False),
])
def test_lacks_lse_atomics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: str, cpuinfo: str,
                           lacks: bool) -> None:
    monkeypatch.setattr(blas_threads.platform, "machine", lambda: machine)
    assert blas_threads.lacks_lse_atomics(write(tmp_path, "cpuinfo", cpuinfo)) is lacks


def test_unreadable_cpuinfo_leaves_the_threads_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas_threads.platform, "machine", lambda: "aarch64")
    assert blas_threads.lacks_lse_atomics(tmp_path / "missing") is False


def test_loaded_nvpl_blas_finds_the_library_by_name(tmp_path: Path) -> None:
    assert blas_threads.loaded_nvpl_blas(write(tmp_path, "maps", NVPL_MAPS)) == \
        "/venv/torch/lib/libnvpl_blas_lp64_gomp.so.0"
    assert blas_threads.loaded_nvpl_blas(write(tmp_path, "maps2", OPENBLAS_MAPS)) is None


class FakeNvpl:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def nvpl_blas_set_num_threads(self, count: int) -> None:
        self.threads.append(count)


@pytest.mark.parametrize(("cpuinfo", "maps", "capped"), [
    (PI4_FEATURES, NVPL_MAPS, True),
    (GRACE_FEATURES, NVPL_MAPS, False),  # a core with atomics keeps NVPL's threads
    (PI4_FEATURES, OPENBLAS_MAPS, False),  # another BLAS (the CPU wheel's) is not NVPL's problem
])
def test_guard_caps_nvpl_only_on_a_core_without_atomics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        cpuinfo: str, maps: str, capped: bool) -> None:
    cpuinfo_path, maps_path = write(tmp_path, "cpuinfo", cpuinfo), write(tmp_path, "maps", maps)
    monkeypatch.setattr(blas_threads.platform, "machine", lambda: "aarch64")
    fake = FakeNvpl()
    opened: list[str] = []

    def cdll(path: str) -> FakeNvpl:
        opened.append(path)
        return fake

    monkeypatch.setattr(blas_threads.ctypes, "CDLL", cdll)
    reason = blas_threads.guard_blas_threads(cpuinfo_path, maps_path)
    assert (reason is not None) is capped
    assert fake.threads == ([1] if capped else [])
    if capped:
        assert opened == ["/venv/torch/lib/libnvpl_blas_lp64_gomp.so.0"] and "SIGILL" in str(reason)


def test_guard_does_nothing_on_this_machine_unless_it_is_an_arm_core_without_atomics() -> None:
    expected = blas_threads.lacks_lse_atomics() and blas_threads.loaded_nvpl_blas() is not None
    assert (blas_threads.guard_blas_threads() is not None) is expected
