"""Keep torch's BLAS on one thread where its multi-threaded path would crash the process: PyPI's aarch64 torch on
an ARMv8.0 core.

PyPI's aarch64 torch (a CUDA build for NVIDIA's Arm servers) does its matrix products with NVIDIA's NVPL BLAS.
With two threads or more, NVPL's sgemm runs LSE atomic instructions (``ldaddal``, ARMv8.1), which a Raspberry Pi
4's Cortex-A72 (ARMv8.0, no ``atomics`` in ``/proc/cpuinfo``'s Features) does not have: the process dies of
SIGILL at its first ``Linear`` layer (emulated with QEMU's cortex-a72: ``benchmarks/arm64_check.sh``). On one
thread NVPL takes another path and trains. :func:`guard_blas_threads` then sets NVPL's own thread count to 1
(``nvpl_blas_set_num_threads``, which later ``torch.set_num_threads`` calls do not undo and forked children
inherit), so torch's other parallel loops keep every thread they were given.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

__all__ = ["guard_blas_threads", "lacks_lse_atomics", "loaded_nvpl_blas"]


def lacks_lse_atomics(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this is an arm64 core without the ARMv8.1 LSE atomics (no ``atomics`` in any Features line)."""
    if platform.machine() not in ("aarch64", "arm64"):
        return False
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False  # unknown: leave the threads alone
    features = [line.split(":", 1)[1].split() for line in text.splitlines()
                if line.startswith("Features") and ":" in line]
    return bool(features) and not any("atomics" in line for line in features)


def loaded_nvpl_blas(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the NVPL BLAS library this process has loaded (torch's BLAS), or None."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and "libnvpl_blas_" in Path(fields[-1]).name:
            return fields[-1]
    return None


def guard_blas_threads(cpuinfo: Path = Path("/proc/cpuinfo"), maps: Path = Path("/proc/self/maps")) -> str | None:
    """Where torch's BLAS is NVPL on an arm64 core without LSE atomics, run NVPL on one thread; the reason when it
    did, None where nothing needed doing. Call after ``import torch`` (it loads NVPL); once per process is
    enough."""
    if not lacks_lse_atomics(cpuinfo):
        return None
    library = loaded_nvpl_blas(maps)
    if library is None:
        return None
    ctypes.CDLL(library).nvpl_blas_set_num_threads(1)
    return (f"BLAS on one thread: {Path(library).name} runs ARMv8.1 atomics on several threads, "
            "which this core lacks (SIGILL)")
