"""common.heap: a daemon's heap gives large blocks back when they are freed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from common import heap


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return self.answer

    def malloc_trim(self, pad: int) -> int:
        self.calls.append((-100, pad))
        return self.answer


def test_the_mmap_threshold_is_fixed_and_the_trim_threshold_set(monkeypatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(heap, "glibc", lambda: libc)
    assert heap.return_large_blocks(1 << 18)
    assert libc.calls == [(heap.M_MMAP_THRESHOLD, 1 << 18), (heap.M_TRIM_THRESHOLD, 1 << 20)]


def test_without_glibc_or_when_refused_it_says_so(monkeypatch) -> None:
    monkeypatch.setattr(heap, "glibc", lambda: None)
    assert heap.return_large_blocks() is False
    refusing = FakeLibc(answer=0)
    monkeypatch.setattr(heap, "glibc", lambda: refusing)
    assert heap.return_large_blocks() is False and len(refusing.calls) == 1


def test_free_memory_is_given_back_with_malloc_trim_and_nothing_else(monkeypatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(heap, "glibc", lambda: libc)
    assert heap.give_back_free_memory() and libc.calls == [(-100, 0)]
    monkeypatch.setattr(heap, "glibc", lambda: None)
    assert heap.give_back_free_memory() is False


# Run in a fresh interpreter, never in the test process: the ~200 MB of blocks leave a hole of free chunks in the
# main arena (later allocations pin the heap's top, so it cannot shrink), and glibc serves any request that fits a
# free chunk from it before it considers a mapping of its own: a later large block (a test's 96 MiB array, say)
# then lands in the hole and stays resident when freed.
_TRIM_PROBE = textwrap.dedent("""
    import psutil
    from common import heap

    process = psutil.Process()
    blocks = [bytearray(1000) for _ in range(200_000)]  # ~200 MB of small heap blocks, touched
    keep = blocks[-1]  # pins the heap's top: the freed blocks stay in the middle of the heap
    del blocks
    before = process.memory_info().rss
    given_back = heap.give_back_free_memory()
    print(given_back, (before - process.memory_info().rss) // 2**20)
""")


def test_free_memory_given_back_by_the_real_c_library_shrinks_rss() -> None:
    # Many small blocks freed in the middle of the heap stay resident until trimmed.
    if heap.glibc() is None or os.environ.get("LD_PRELOAD"):
        pytest.skip("glibc's malloc is not the one in use here")
    result = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    given_back, dropped_mib = result.stdout.split()
    assert given_back == "True" and int(dropped_mib) > 50, result.stdout
