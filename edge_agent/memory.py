"""What memory the device really has: min(psutil available, own cgroup v2 headroom, configured budget).

psutil alone ignores cgroup limits (systemd's MemoryMax=, containers); a Raspberry Pi kernel may have the
memory cgroup disabled, in which case there is simply no cgroup limit to read.
"""

from __future__ import annotations

import platform
from pathlib import Path

import psutil

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
