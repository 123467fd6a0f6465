"""Whether the kernel's OOM killer struck while a training child ran.

A child killed by SIGKILL was out of memory only if the kernel counted an OOM kill meanwhile; any other SIGKILL
(an operator, a supervisor) says nothing about memory and must not teach the calibration. The counter read is the
agent's own cgroup v2 ``memory.events`` ``oom_kill`` (hierarchical: kills in child cgroups count), and where the
memory controller is not there (cgroup v1, a Raspberry Pi kernel booted without it) the kernel's account of every
OOM kill, ``oom_kill`` in ``/proc/vmstat`` (Linux 4.13+), which may also count another process killed at the same
time. Where neither is readable no kill can be told from a manual one, and none is taken for out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_agent.memory import own_cgroup_dir

VMSTAT = Path("/proc/vmstat")


@dataclass(frozen=True)
class OomCount:
    """One reading of an OOM-kill counter: where it came from and its value."""

    source: str
    kills: int


def _counter(path: Path, key: str) -> int | None:
    """The value of ``key`` in a ``key value`` per line file; None when unreadable or absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def oom_kills(cgroup_dir: Path | None = None, vmstat: Path = VMSTAT) -> OomCount | None:
    """The OOM kills counted so far: the cgroup's (``cgroup_dir``, default this process's), else the kernel's;
    None when neither can be read."""
    directory = cgroup_dir if cgroup_dir is not None else own_cgroup_dir()
    if directory is not None:
        events = directory / "memory.events"
        kills = _counter(events, "oom_kill")
        if kills is not None:
            return OomCount(str(events), kills)
    kills = _counter(vmstat, "oom_kill")
    return OomCount(str(vmstat), kills) if kills is not None else None


def struck(before: OomCount | None, after: OomCount | None) -> bool | None:
    """Whether an OOM kill was counted between two readings; None when that cannot be told."""
    if before is None or after is None or before.source != after.source:
        return None
    return after.kills > before.kills
