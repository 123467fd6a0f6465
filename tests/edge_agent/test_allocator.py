"""The training child's heap setting: validation, the fallbacks (no page pool, no glibc), and what "compact" does
to the RSS (the page pool's own tests: ``test_page_pool``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from edge_agent import allocator

needs_glibc = pytest.mark.skipif(not allocator.compact_supported(), reason="needs glibc's mallopt")

# In a fresh interpreter: set the heap up, allocate and free a 4 MiB block after a 16 MiB one (the free of the
# large mapped block is what raises glibc's dynamic mmap threshold), settle the heap if asked, and print how much
# RSS stayed behind.
_PROBE = textwrap.dedent("""
    import sys
    from edge_agent import allocator
    from edge_agent.child import rss_bytes
    allocator.configure(sys.argv[1])
    import numpy as np
    baseline = rss_bytes()
    for size in (16 << 20, 4 << 20):
        block = np.ones(size // 8)
        del block
    if sys.argv[2:] == ["settle"]:
        allocator.settle(sys.argv[1])
    print(rss_bytes() - baseline)
""")


def _retained_after_free(mode: str, *extra: str) -> int:
    result = subprocess.run([sys.executable, "-c", _PROBE, mode, *extra], capture_output=True, text=True,
                            check=True)
    return int(result.stdout.strip())


def test_resolve_accepts_the_settings_and_rejects_others():
    assert allocator.resolve("default") == "default"
    assert allocator.resolve("compact") in ("compact", "default")
    assert allocator.resolve("pooled") in ("pooled", "compact", "default")
    with pytest.raises(ValueError, match="allocator must be one of pooled, compact, default"):
        allocator.resolve("jemalloc")


def test_resolve_falls_back_to_default_without_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert not allocator.compact_supported()
    assert allocator.resolve("compact") == "default"
    assert allocator.resolve("pooled") == "default"
    allocator.configure("default")  # nothing to do, nothing raised
    with pytest.raises(RuntimeError, match="needs glibc's mallopt"):
        allocator.configure("compact")


@needs_glibc
def test_pooled_falls_back_to_compact_without_the_page_pool(monkeypatch):
    # Same peaks, slower steps: what a device without a C compiler runs.
    monkeypatch.setattr(allocator.page_pool, "library_path", lambda: None)
    assert allocator.resolve("pooled") == "compact"


@needs_glibc
def test_a_process_without_the_pool_preloaded_configures_compact_for_pooled():
    probe = "from edge_agent import allocator; print(allocator.configure('pooled'))"
    environment = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            env=environment)
    assert result.stdout.strip() == "compact"


@needs_glibc
def test_compact_heap_gives_freed_blocks_back_at_once():
    assert _retained_after_free("compact") < 1 << 20


@needs_glibc
def test_default_heap_keeps_a_freed_block_that_compact_gives_back():
    # The contrast "compact" exists for: with glibc's dynamic threshold the 4 MiB block came from the heap and
    # stays resident after it is freed.
    assert _retained_after_free("default") >= 3 << 20


@needs_glibc
def test_settle_gives_back_what_the_default_heap_kept():
    # What the child does before its baseline, so that the kept block cannot absorb training's allocations.
    assert _retained_after_free("default", "settle") < 1 << 20


def test_settle_validates_the_setting_and_needs_no_glibc(monkeypatch):
    with pytest.raises(ValueError, match="allocator must be one of"):
        allocator.settle("tcmalloc")
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    allocator.settle("default")  # nothing to trim with, nothing raised


def test_the_agent_knows_the_settings_the_estimator_knows():
    from models.memory import CPU_ALLOCATORS

    assert allocator.ALLOCATORS == CPU_ALLOCATORS


RETAINED = """
    import sys

    import numpy as np
    import psutil

    from edge_agent import allocator

    if sys.argv[1] == "configured":
        assert allocator.configure_agent_process()
    process = psutil.Process()
    before = process.memory_info().rss
    big = np.ones(30 * 2**20, np.uint8)  # a task's weights: mapped, and freed
    del big
    parts = [np.ones(900 * 2**10, np.uint8) for _ in range(40)]  # then its chunks
    del parts
    print((process.memory_info().rss - before) // 2**20)
"""


@pytest.mark.skipif(not allocator.compact_supported(), reason="needs glibc's mallopt")
def test_the_agent_process_gives_freed_task_memory_back():
    """glibc's default keeps what the chunks needed after a large block raised its thresholds; the agent's
    setting gives it back."""

    def retained(mode: str) -> int:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(RETAINED), mode], capture_output=True,
                                text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        return int(result.stdout)

    assert retained("glibc default") >= 20  # MiB kept: the case the setting exists for
    assert retained("configured") <= 4
