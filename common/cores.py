"""The CPU cores this process may really use: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores, not those a process gets: a systemd unit with ``CPUQuota=200%``
or ``AllowedCPUs=``, a container with ``--cpus=2`` or a ``taskset`` sees all of them and would start as many
threads, which then wait for each other (an intra-op thread pool is only as fast as its slowest thread).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["available_cores", "cgroup_cpu_limit"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup")) -> str | None:
    """This process's cgroup v2 path (``0::/system.slice/fedfit-agent.service``), or None without cgroup v2."""
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip() or "/"
    except OSError:
        return None
    return None


def cgroup_cpu_limit(root: Path = _CGROUP_ROOT, cgroup: str | None = None) -> float | None:
    """The tightest ``cpu.max`` quota (in cores) of this process's cgroup and its ancestors, None when unlimited
    or unknown (cgroup v1, no ``cpu`` controller, unreadable files)."""
    path = cgroup if cgroup is not None else _own_cgroup()
    if path is None:
        return None
    tightest: float | None = None
    current = root / path.strip("/")
    while True:
        try:
            quota, period = (current / "cpu.max").read_text().split()[:2]
            if quota != "max" and float(period) > 0:
                cores = float(quota) / float(period)
                tightest = cores if tightest is None else min(tightest, cores)
        except (OSError, ValueError):
            pass
        if current == root or root not in current.parents:
            break
        current = current.parent
    return tightest


def available_cores() -> int:
    """Cores this process can run on at once: its CPU affinity, capped by its cgroup's quota (rounded up: a
    quota of 1.5 cores keeps two threads busy part of the time); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)
