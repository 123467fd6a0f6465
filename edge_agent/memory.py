"""What memory the device really has: min(psutil available, own cgroup v2 headroom, configured budget), and on
a discrete GPU its free memory.

psutil alone ignores cgroup limits (systemd's MemoryMax=, containers); a Raspberry Pi kernel may have the
memory cgroup disabled, in which case there is simply no cgroup limit to read. The agent process holds no torch,
so a GPU's free memory comes from NVIDIA's management library (NVML) through ctypes; a Jetson has none and needs
none (its GPU shares the system memory psutil reports).
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from pathlib import Path

import psutil

from protocol import ProtocolError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_cgroup_dir(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> Path | None:
    """The cgroup v2 directory of this process, from the ``0::/path`` line of /proc/self/cgroup."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            relative = line[3:].strip().lstrip("/")
            return root / relative if relative else root
    return None


def cgroup_headroom(cgroup_dir: Path | None) -> int | None:
    """``memory.max - memory.current`` of a cgroup v2 directory; None when unlimited or unreadable."""
    if cgroup_dir is None:
        return None
    try:
        limit_text = (cgroup_dir / "memory.max").read_text().strip()
        current = int((cgroup_dir / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit_text == "max":
        return None
    try:
        return max(0, int(limit_text) - current)
    except ValueError:
        return None


def available_memory(budget_bytes: int | None = None, cgroup_dir: Path | None = None) -> int:
    """Bytes training may use now: the smallest of psutil's available, the cgroup headroom and the budget."""
    candidates = [int(psutil.virtual_memory().available)]
    headroom = cgroup_headroom(cgroup_dir if cgroup_dir is not None else own_cgroup_dir())
    if headroom is not None:
        candidates.append(headroom)
    if budget_bytes is not None:
        candidates.append(budget_bytes)
    return min(candidates)


def size_text(count: int) -> str:
    """Bytes in the unit that reads best (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count / 2**10:.1f} KiB"


def total_memory() -> int:
    """Physical memory of the device in bytes."""
    return int(psutil.virtual_memory().total)


def detect_device_kind() -> str:
    """"jetson", "raspberry-pi" or the machine architecture, from what the board tells about itself."""
    if Path("/etc/nv_tegra_release").exists():
        return "jetson"
    try:
        model = Path("/proc/device-tree/model").read_text(errors="replace")
    except OSError:
        model = ""
    if "Raspberry Pi" in model:
        return "raspberry-pi"
    if "Jetson" in model or "NVIDIA" in model:
        return "jetson"
    return f"generic-{platform.machine() or 'unknown'}"


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _visible_gpu_index() -> int:
    """The NVML index of the GPU torch uses first: the first of ``CUDA_VISIBLE_DEVICES`` when it is a number."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


@cache
def _load(library: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(library)
    except OSError:
        return None


def gpu_free_memory(library: str = "libnvidia-ml.so.1") -> int | None:
    """Free memory of the GPU training runs on, from NVML; None where there is no NVML or no such GPU."""
    nvml = _load(library)
    if nvml is None:
        return None
    handle = ctypes.c_void_p()
    memory = _NvmlMemory()
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(_visible_gpu_index()), ctypes.byref(handle)) != 0:
                return None
            if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
                return None
            return int(memory.free)
        finally:
            nvml.nvmlShutdown()
    except AttributeError:  # a library of that name without these functions
        return None


def admit_task(total: int, limit: int) -> None:
    """Refuse a task transfer at its first chunk (ProtocolError) when it is larger than ``limit`` bytes
    (``limits.max_task_bytes``), or when buffering it and decoding its weights (about twice its size) would not fit
    the memory the device has now: nothing of it is buffered."""
    if total > limit:
        raise ProtocolError(f"task refused at its first chunk: it is {size_text(total)}, more than "
                            f"limits.max_task_bytes {size_text(limit)}")
    available = available_memory()
    if 2 * total > available:
        raise ProtocolError(f"task refused at its first chunk: buffering and decoding its {size_text(total)} "
                            f"needs about {size_text(2 * total)}, {size_text(available)} are available")
