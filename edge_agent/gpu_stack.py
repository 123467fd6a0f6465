"""Whether this machine has a GPU torch could use, and keeping torch's optional GPU packages out of a process
that has none or will not use it (the training forkserver, before it imports torch: ``edge_agent.child_warmup``).

torch's CUDA build imports ``cuda.bindings`` (CUDA's Python bindings: about 10 MB resident) with torch, and
``triton`` (the GPU kernel compiler: about 75 MB, 70 of them its library's pages) with ``torch._dynamo``, which
the first optimizer imports. Both are optional to torch (its CPU builds install neither; every import of them in
torch is guarded, ``torch.utils._triton.has_triton_package`` and the ``try``/``except ImportError`` around
``cuda.bindings``), and neither does anything without a GPU. Marking a module ``None`` in ``sys.modules`` is the
import system's documented "not available": the import raises ``ImportError`` and torch takes its path for a
machine without it. This module imports nothing outside the standard library and loads or initialises no driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["CPU_ONLY_ENV", "DEVICE_FILES", "DRIVER_LIBRARIES", "OPTIONAL_MODULES", "gpu_files_open", "gpu_present",
           "gpu_wanted", "hide_gpus", "keep_out", "probe_without_cuda"]

#: Set to "1" in the training forkserver's environment when every agent of the process that starts it trains on
#: the CPU (``device: cpu``): a GPU may be present, but nothing there will use it.
CPU_ONLY_ENV = "FEDFIT_TRAIN_ON_CPU_ONLY"

#: Device files a GPU driver creates: NVIDIA's for discrete GPUs, Jetson's integrated GPU (``nvhost``, ``nvgpu``),
#: ROCm's (``kfd``) and WSL 2's GPU (``dxg``).
DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu", "/dev/kfd", "/dev/dxg")
#: The driver libraries CUDA and ROCm initialise through (installed with the driver, never with a wheel).
DRIVER_LIBRARIES = ("libcuda.so", "libamdhip64.so")
#: torch's optional GPU packages, left out where there is no GPU.
OPTIONAL_MODULES = ("triton", "cuda.bindings")
#: CUDA's own variable, read once when CUDA initialises in a process: empty, it shows that process no GPU.
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
#: torch's variable that makes ``torch.cuda.is_available()`` count GPUs through NVML instead of initialising CUDA.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def gpu_present() -> bool:
    """Whether a GPU driver is here: one of :data:`DEVICE_FILES`, or one of :data:`DRIVER_LIBRARIES` where the
    dynamic loader finds it (its cache, ``LD_LIBRARY_PATH``; some drivers create their device files only when
    CUDA first starts). Told without loading anything."""
    return any(os.path.exists(path) for path in DEVICE_FILES) or _loader_finds(DRIVER_LIBRARIES)


def gpu_wanted() -> bool:
    """Whether this process may train on a GPU: one is present (:func:`gpu_present`) and its starter did not say
    that it trains on the CPU only (:data:`CPU_ONLY_ENV`)."""
    return os.environ.get(CPU_ONLY_ENV) != "1" and gpu_present()


def _loader_finds(prefixes: tuple[str, ...]) -> bool:
    """Whether a library whose file name starts with one of ``prefixes`` is in the dynamic loader's cache
    (``ldconfig -p``) or a directory of ``LD_LIBRARY_PATH``."""
    for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        try:
            if any(entry.name.startswith(prefixes) for entry in Path(directory).iterdir()):
                return True
        except OSError:
            continue
    ldconfig = shutil.which("ldconfig") or next((path for path in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                                 if os.path.exists(path)), None)
    if ldconfig is None:
        return False
    try:
        listed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.strip().startswith(prefixes) for line in listed.splitlines())


def keep_out(names: tuple[str, ...] = OPTIONAL_MODULES) -> list[str]:
    """Make ``names`` unimportable in this process (those not imported yet); returns the ones it kept out."""
    kept = [name for name in names if name not in sys.modules]
    for name in kept:
        sys.modules[name] = None  # type: ignore[assignment]
    return kept


def hide_gpus() -> None:
    """Show this process, and the processes it starts, no GPU (:data:`VISIBLE_DEVICES_ENV` empty); call it
    before anything initialises CUDA here.

    A process that trains on the CPU needs this on a machine with a GPU: torch's autograd engine counts the GPUs
    at its first backward pass (``Engine::start_device_threads``), which initialises CUDA in that process, starts
    a thread per GPU and registers a fork handler after which every child forked from the process refuses
    autograd ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). With no
    GPU visible the engine counts none, starts nothing and registers nothing, as on a machine without a GPU.
    """
    os.environ[VISIBLE_DEVICES_ENV] = ""


def probe_without_cuda() -> None:
    """Have ``torch.cuda.is_available()`` in this process (and its children) ask NVML instead of initialising
    CUDA (:data:`NVML_CHECK_ENV`), so that a check made by some import cannot make CUDA unusable in the
    children forked afterwards; where NVML is missing (a Jetson) torch falls back to asking CUDA."""
    os.environ.setdefault(NVML_CHECK_ENV, "1")


#: Where GPU drivers' device files live: NVIDIA's (``/dev/nvidia*``), Jetson's (``/dev/nvhost-*``, ``/dev/nvmap``,
#: ``/dev/nvgpu``), ROCm's and WSL 2's.
DEVICE_FILE_PREFIXES = ("/dev/nvidia", "/dev/nvhost", "/dev/nvmap", "/dev/nvgpu", "/dev/kfd", "/dev/dxg")


def gpu_files_open(pid: int | str = "self") -> list[str]:
    """The GPU driver's device files process ``pid`` holds open: a process that started CUDA holds them, one whose
    library was merely loaded does not (the training forkserver must hold none: a CUDA started before the fork
    is unusable in the child)."""
    found = []
    directory = Path(f"/proc/{pid}/fd")
    for entry in directory.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith(DEVICE_FILE_PREFIXES):
            found.append(target)
    return sorted(set(found))

