"""Telling whether a GPU driver is here without loading one, and keeping torch's optional GPU packages out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge_agent import gpu_stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_driver(monkeypatch, tmp_path):
    """A machine with none of the device files, nothing on LD_LIBRARY_PATH and an ldconfig that lists libc only."""
    monkeypatch.setattr(gpu_stack, "DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "lib"))
    listing = "2 libs found in cache\n\tlibc.so.6 (libc6,x86-64) => /lib/libc.so.6\n"
    monkeypatch.setattr(gpu_stack.subprocess, "run", lambda *args, **kwargs: SimpleNamespace(stdout=listing))
    return tmp_path


def test_no_device_file_and_no_driver_library_is_no_gpu(no_driver):
    assert gpu_stack.gpu_present() is False


def test_a_device_file_is_a_gpu(no_driver):
    (no_driver / "nvidiactl").touch()
    assert gpu_stack.gpu_present() is True


def test_a_driver_library_the_loader_finds_is_a_gpu(no_driver, monkeypatch):
    (no_driver / "lib").mkdir()
    (no_driver / "lib" / "libcuda.so.1").touch()
    assert gpu_stack.gpu_present() is True
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    listing = "\tlibcuda.so.1 (libc6,AArch64) => /usr/lib/aarch64-linux-gnu/tegra/libcuda.so.1\n"
    monkeypatch.setattr(gpu_stack.subprocess, "run", lambda *args, **kwargs: SimpleNamespace(stdout=listing))
    assert gpu_stack.gpu_present() is True


def test_a_gpu_is_not_wanted_where_the_starter_trains_on_the_cpu_only(no_driver, monkeypatch):
    (no_driver / "nvidiactl").touch()
    monkeypatch.delenv(gpu_stack.CPU_ONLY_ENV, raising=False)
    assert gpu_stack.gpu_wanted() is True
    monkeypatch.setenv(gpu_stack.CPU_ONLY_ENV, "1")
    assert gpu_stack.gpu_wanted() is False
    (no_driver / "nvidiactl").unlink()
    monkeypatch.delenv(gpu_stack.CPU_ONLY_ENV)
    assert gpu_stack.gpu_wanted() is False  # no GPU: not wanted either way


def test_kept_out_modules_cannot_be_imported_and_imported_ones_stay(monkeypatch):
    monkeypatch.delitem(sys.modules, "fedfit_test_gpu_package", raising=False)  # removed again after the test
    assert gpu_stack.keep_out(("fedfit_test_gpu_package", "json")) == ["fedfit_test_gpu_package"]
    with pytest.raises(ImportError):
        __import__("fedfit_test_gpu_package")
    assert sys.modules["json"] is not None


@pytest.mark.slow
def test_torch_trains_with_its_gpu_packages_kept_out():
    """torch, torch._dynamo and an optimizer step take their path for a machine without triton and
    cuda.bindings (torch's CPU builds install neither)."""
    code = textwrap.dedent("""
        import json, sys
        from edge_agent import gpu_stack
        kept = gpu_stack.keep_out()
        import torch
        import torch._dynamo
        from torch.utils._triton import has_triton_package
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        print(json.dumps([kept, has_triton_package(), [name for name in gpu_stack.OPTIONAL_MODULES
                                                       if sys.modules.get(name) is not None]]))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '[["triton", "cuda.bindings"], false, []]'


def test_hiding_the_gpus_empties_cudas_list_and_the_nvml_check_keeps_a_setting_given(monkeypatch):
    monkeypatch.setenv(gpu_stack.VISIBLE_DEVICES_ENV, "0,1")
    monkeypatch.setenv(gpu_stack.NVML_CHECK_ENV, "0")
    gpu_stack.hide_gpus()
    gpu_stack.probe_without_cuda()
    assert os.environ[gpu_stack.VISIBLE_DEVICES_ENV] == ""
    assert os.environ[gpu_stack.NVML_CHECK_ENV] == "0"  # the user's choice stands
    monkeypatch.delenv(gpu_stack.NVML_CHECK_ENV)
    gpu_stack.probe_without_cuda()
    assert os.environ[gpu_stack.NVML_CHECK_ENV] == "1"


def test_the_gpu_files_a_process_holds_are_its_open_driver_device_files(tmp_path, monkeypatch):
    """Only open files under a driver's device names count (a process that started CUDA holds /dev/nvidiactl)."""
    fake = tmp_path / "dev" / "nvidiactl"
    fake.parent.mkdir()
    fake.write_text("")
    monkeypatch.setattr(gpu_stack, "DEVICE_FILE_PREFIXES", (str(tmp_path / "dev" / "nvidia"),))
    before = gpu_stack.gpu_files_open()
    with open(fake) as _held, open(tmp_path / "other", "w") as _other:
        assert gpu_stack.gpu_files_open() == [str(fake)]
        assert gpu_stack.gpu_files_open(os.getpid()) == [str(fake)]
    assert before == [] and gpu_stack.gpu_files_open() == []
