"""How a training child manages its C heap: a predictable, low peak, faster than compact.

``"pooled"`` (the default) is ``"compact"`` below with the page pool (``edge_agent.page_pool``) preloaded into the
training forkserver: every block of a page or more is still a mapping of its own, but the pages of a freed block
are kept and reused by the next request (as they are, or shrunk or grown in place), never more of them than the
high-water mark of the live blocks (a large block freed with pages it never wrote is not kept, and the mark
loses those bytes), so the peak is the compact heap's while the pages a step reuses are not faulted in again. Measured side by side (``benchmarks/training_speed.py``, x86-64 with AVX2, one thread, the CNN's
rows): peaks those of ``"compact"``; steps 1.15-1.68 times glibc's defaults where ``"compact"`` takes 1.23-2.33
(as fast as the defaults while the pool populated its pages, which made partly written blocks resident:
docs/edge-runtime.md). Where the pool cannot be built (no C compiler) or loaded, ``"pooled"`` resolves to
``"compact"``: the same peaks, the slower steps.

With glibc's default settings, memory a training step frees stays in the process heap and the next step does
not fit into it in place, so the resident peak carries about one more copy of the step's working set, and by how
much varies from run to run (see docs/edge-runtime.md, "Memory estimator"). ``"compact"`` fixes glibc's mmap threshold at 4 KiB (which
also switches off its dynamic growth): every block of a page or more, every tensor but the tiniest, is mapped on
allocation and returned to the system when freed, so the peak follows the live tensors page by page. (At 64 KiB
the small tensors of narrow models stayed in the heap, and how much of them the heap's free chunks absorbed
moved the smallest benchmark rows by 0.5 MB between runs.) Measured on the benchmark rows (x86-64, one thread):
within 6% of the estimate wherever training needs more than 5 MB, CNN width 1 at batch 128 peaks at 149 MB
above the baseline against 280 MB with glibc's defaults; steps are 1.5-3 times slower (the kernel faults the
pages in again every step).
``"default"`` leaves glibc alone: higher and noisier peaks. The estimator takes the same word (``allocator=``),
so the agent predicts what it will run; ``"pooled"`` and ``"compact"`` share one estimate.

Only glibc has ``mallopt``; elsewhere :func:`resolve` falls back to ``"default"``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from common import heap
from edge_agent import page_pool

__all__ = ["AGENT_MMAP_THRESHOLD", "ALLOCATORS", "COMPACT_MMAP_THRESHOLD", "compact_supported", "configure",
           "configure_agent_process", "resolve", "settle", "start_stage"]

#: The settings, as the estimator knows them (``models.memory.CPU_ALLOCATORS``; spelt out here because the agent
#: process, which resolves the setting, imports nothing of ``models``, and with it no torch).
ALLOCATORS = ("pooled", "compact", "default")

#: Blocks at least this large (one page) are mapped and unmapped individually in ``"compact"`` mode.
COMPACT_MMAP_THRESHOLD = 4 * 1024
#: The agent process's own fixed mmap threshold (:func:`configure_agent_process`).
AGENT_MMAP_THRESHOLD = heap.DAEMON_MMAP_THRESHOLD
_M_TRIM_THRESHOLD = heap.M_TRIM_THRESHOLD
_M_MMAP_THRESHOLD = heap.M_MMAP_THRESHOLD


def _libc() -> ctypes.CDLL | None:
    """glibc, or None (:func:`common.heap.glibc`; a seam the tests replace)."""
    return heap.glibc()


def compact_supported() -> bool:
    """Whether this process can run the ``"compact"`` heap (glibc's ``mallopt`` is available)."""
    return _libc() is not None


def resolve(requested: str) -> str:
    """The allocator a training child here will really run: ``requested``; ``"compact"`` for ``"pooled"`` where
    the page pool cannot be built or loaded, or another allocator is preloaded; ``"default"`` without glibc.
    (Builds the pool on first use.)"""
    if requested not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {requested!r}.")
    if requested == "default" or not compact_supported():
        return "default"
    if requested == "pooled" and not page_pool.usable():
        return "compact"
    return requested


def configure(allocator: str) -> str:
    """Apply ``allocator`` to THIS process's heap (call it in the training child before training).

    ``"default"`` changes nothing. ``"compact"`` fixes the mmap threshold at :data:`COMPACT_MMAP_THRESHOLD` and
    the trim threshold at twice that (the heap's top goes back to the system once that much of it is free, where
    glibc's default waits for 128 KiB); raises ``RuntimeError`` where
    ``mallopt`` is missing or refuses, since estimates made for ``"compact"`` would then be wrong. ``"pooled"``
    does the same and hands every block of :data:`COMPACT_MMAP_THRESHOLD` or more to the page pool; in a process
    started without the pool preloaded it stays ``"compact"`` (same peaks). Returns the word applied.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}.")
    if not compact_supported() and allocator != "default":
        raise RuntimeError(f"allocator {allocator!r} needs glibc's mallopt, which this process does not have")
    if allocator == "default":
        return allocator
    libc = _libc()
    assert libc is not None
    settings = ((_M_MMAP_THRESHOLD, COMPACT_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2 * COMPACT_MMAP_THRESHOLD))
    for option, value in settings:
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"mallopt({option}, {value}) failed")
    if allocator == "pooled" and page_pool.enable(COMPACT_MMAP_THRESHOLD):
        return "pooled"
    return "compact"


def configure_agent_process() -> bool:
    """Keep the agent process's heap from holding on to what a task's messages needed (``fedfit agent`` calls it):
    :func:`common.heap.return_large_blocks` at :data:`AGENT_MMAP_THRESHOLD` (measured: +178 MiB of RSS kept after
    six refused tasks of 23 to 33 MiB without it, +0.1 MiB with it, ``benchmarks/footprint.py``). The training
    children set their own heap (:func:`configure`). Returns False, changing nothing, without glibc."""
    return heap.return_large_blocks(AGENT_MMAP_THRESHOLD)


def settle(allocator: str) -> None:
    """Before a measurement's baseline: give the heap's free memory back to the system (``malloc_trim(0)``).

    What an earlier step freed and the heap kept would otherwise be reused by training without showing in the
    RSS: glibc's default heap keeps a whole working set, which would hide below the baseline; even the compact
    heap keeps a warm-up step's blocks under a page. Trimmed, the peak above the baseline counts every page
    training touches; the page pool gives back every page it kept. ``allocator`` is validated; without glibc
    nothing is done.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}.")
    page_pool.release()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def start_stage(allocator: str) -> None:
    """At the start of a training stage: the page pool gives back what the previous stage's blocks left kept, so
    the stage's peak (measured from here, estimated alone) is its own. Nothing to do for the other heaps."""
    if allocator == "pooled":
        page_pool.release()
