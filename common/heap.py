"""A daemon's C heap that gives large blocks back when they are freed (glibc).

glibc raises its mmap threshold to the size of every mapped block freed (up to 32 MiB), and its trim threshold to
twice that: after a daemon freed a message's megabyte chunks and its tens of megabytes of weights, blocks of up to
that size come from the heap and stay there once freed. For the agent that kept +178 MiB of RSS after six refused
tasks of 23 to 33 MiB (``benchmarks/footprint.py``); for the coordinator, the 1.7 GB of updates queued while a
1000-agent round was collected (``benchmarks/fleet_load.py``). Two remedies: a fixed mmap threshold (which also
switches the adjustment off) and a trim threshold of 1 MiB give every large block back when it is freed (the
agent's process, which allocates little); `give_back_free_memory` gives the free pages back at a moment the caller
chooses (the coordinator, after each round: its hot path allocates megabytes per update, and a fixed threshold
made each of them a fresh, zeroed mapping).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

__all__ = ["DAEMON_MMAP_THRESHOLD", "give_back_free_memory", "glibc", "return_large_blocks"]

#: The daemons' fixed mmap threshold: blocks of this size or more are mapped, and unmapped when freed.
DAEMON_MMAP_THRESHOLD = 256 * 1024
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


@cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim.restype = ctypes.c_int
    return libc


def give_back_free_memory() -> bool:
    """Give the free pages of every heap arena back to the system now (glibc's ``malloc_trim(0)``), leaving the
    allocator's thresholds alone: what the coordinator does after each round, the cheap way to the RSS a fixed
    mmap threshold gives. (That threshold maps and faults in every large block afresh: with it, the 1000-agent
    load run's coordinator used twice the CPU per round, 96 against 51 s.) Whether any was given back; False
    without glibc."""
    trim = getattr(glibc(), "malloc_trim", None)
    return trim is not None and trim(0) == 1


def return_large_blocks(threshold: int = DAEMON_MMAP_THRESHOLD) -> bool:
    """Fix this process's mmap threshold at ``threshold`` and its trim threshold at 1 MiB (see the module
    docstring). Returns False, changing nothing, without glibc."""
    libc = glibc()
    if libc is None:
        return False
    for option, value in ((M_MMAP_THRESHOLD, threshold), (M_TRIM_THRESHOLD, 1024 * 1024)):
        if libc.mallopt(option, value) != 1:
            return False
    return True
