"""The page pool: built from its source, preloaded into a fresh interpreter, and held to its promises there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edge_agent import allocator, page_pool

LIBRARY = page_pool.library_path()
needs_pool = pytest.mark.skipif(LIBRARY is None or not allocator.compact_supported(),
                                reason="the page pool needs glibc and a C compiler")

# Helpers every probe starts with: malloc's interface as the process sees it (the pool's, preloaded).
_PRELUDE = textwrap.dedent("""
    import ctypes, os, sys
    from edge_agent import page_pool
    process = ctypes.CDLL(None)
    process.malloc.restype = ctypes.c_void_p
    process.malloc.argtypes = (ctypes.c_size_t,)
    process.calloc.restype = ctypes.c_void_p
    process.calloc.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
    process.realloc.restype = ctypes.c_void_p
    process.realloc.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    process.free.argtypes = (ctypes.c_void_p,)
    process.posix_memalign.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t)
    process.malloc_usable_size.argtypes = (ctypes.c_void_p,)
    process.malloc_usable_size.restype = ctypes.c_size_t
    MiB = 1 << 20
""")


def run_probe(body: str) -> str:
    """Run ``body`` after the prelude in a fresh interpreter with the pool preloaded; its stdout."""
    env = {**os.environ, "LD_PRELOAD": str(LIBRARY)}
    done = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_library_name_follows_the_source(tmp_path, monkeypatch):
    # A changed source is never run stale: the digest in the name changes with it.
    source = tmp_path / "page_pool.c"
    source.write_text(page_pool.SOURCE.read_text())
    monkeypatch.setattr(page_pool, "SOURCE", source)
    before = page_pool.library_name()
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert page_pool.library_name() != before


def test_a_missing_compiler_is_a_clear_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(page_pool.BuildFailed, match="could not build|failed"):
        page_pool.build(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing half-written left behind


def test_without_the_pool_the_functions_change_nothing():
    # This test process does not preload the pool.
    assert not page_pool.loaded()
    assert page_pool.stats() is None
    assert page_pool.enable(4096) is False
    page_pool.release()  # nothing to give back, nothing raised


@needs_pool
def test_preloaded_but_not_enabled_it_passes_everything_to_glibc():
    out = run_probe("""
        assert page_pool.loaded()
        blocks = [process.malloc(2 * MiB) for _ in range(4)]
        for block in blocks:
            process.free(block)
        print(page_pool.stats())
    """)
    assert "live_bytes=0, kept_bytes=0, high_water_bytes=0, maps=0" in out


@needs_pool
def test_a_freed_block_is_reused_without_a_new_mapping():
    out = run_probe("""
        page_pool.enable(4096)
        first = process.malloc(3 * MiB)
        ctypes.memset(first, 7, 3 * MiB)
        process.free(first)
        after_first = page_pool.stats()
        again = process.malloc(3 * MiB)
        stats = page_pool.stats()
        assert again == first, (again, first)  # the same pages, as they are
        assert stats.maps == after_first.maps == 1 and stats.kept_bytes == 0, stats
        smaller = process.malloc(1 * MiB)  # nothing kept: a new mapping
        process.free(again)
        shrunk = process.malloc(2 * MiB)  # the kept 3 MiB block, shrunk in place
        assert shrunk == first and page_pool.stats().maps == 2, page_pool.stats()
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_pool
def test_what_is_kept_never_exceeds_the_live_high_water_mark():
    out = run_probe("""
        import random
        page_pool.enable(4096)
        rng = random.Random(0)
        live = []
        for step in range(3000):
            if live and (rng.random() < 0.5 or len(live) > 40):
                process.free(live.pop(rng.randrange(len(live))))
            else:
                live.append(process.malloc(rng.choice([5000, 70000, 300000, 1 << 20, 3 << 20])))
            stats = page_pool.stats()
            assert stats.live_bytes + stats.kept_bytes <= stats.high_water_bytes, (step, stats)
        for block in live:
            process.free(block)
        stats = page_pool.stats()  # (the interpreter's own large blocks are pooled too: a few pages live)
        assert stats.live_bytes < MiB and 0 < stats.kept_bytes <= stats.high_water_bytes, stats
        page_pool.release()
        stats = page_pool.stats()
        assert stats.kept_bytes == 0 and stats.high_water_bytes == stats.live_bytes, stats
        print(stats.maps)
    """)
    assert int(out) > 0


@needs_pool
def test_the_resident_peak_is_the_live_peak():
    # A step's pattern repeated: the RSS high-water mark follows the live blocks, not live plus kept.
    out = run_probe("""
        from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
        page_pool.enable(4096)
        def step():
            acts = [process.malloc(size) for size in (4 * MiB, 2 * MiB, 6 * MiB, 1 * MiB)]
            for block, size in zip(acts, (4 * MiB, 2 * MiB, 6 * MiB, 1 * MiB)):
                ctypes.memset(block, 1, size)
            for block in acts[::-1]:
                process.free(block)
            grads = [process.malloc(size) for size in (3 * MiB, 5 * MiB)]
            for block, size in zip(grads, (3 * MiB, 5 * MiB)):
                ctypes.memset(block, 2, size)
            for block in grads:
                process.free(block)
        step()
        page_pool.release()
        baseline = rss_bytes(); reset_peak_rss()
        maps_before = page_pool.stats().maps
        for _ in range(5):
            step()
        print((peak_rss_bytes() - baseline) / MiB, page_pool.stats().maps - maps_before)
    """)
    peak_mib, maps = out.split()
    assert float(peak_mib) <= 13 + 1, out  # the live peak is 13 MiB (+ headers, page rounding, interpreter)
    assert float(peak_mib) >= 12, out  # and the pages were really touched
    assert int(maps) <= 10, out  # at most one new mapping in three allocations (the compact heap: every one)


@needs_pool
def test_calloc_realloc_and_alignment_keep_their_contracts():
    out = run_probe("""
        page_pool.enable(4096)
        block = process.malloc(MiB)
        ctypes.memset(block, 0xAB, MiB)
        process.free(block)
        zeroed = process.calloc(1, MiB)  # the same pages again: they must read zero
        assert zeroed == block
        assert ctypes.string_at(zeroed, MiB) == bytes(MiB)
        ctypes.memset(zeroed, 0x5A, MiB)
        grown = process.realloc(zeroed, 3 * MiB)
        assert ctypes.string_at(grown, MiB) == b"\\x5a" * MiB
        assert process.malloc_usable_size(grown) >= 3 * MiB
        small = process.malloc(100)  # under the threshold: glibc's
        assert process.malloc_usable_size(small) >= 100
        process.free(small)
        for alignment in (64, 256, 4096):
            out = ctypes.c_void_p()
            assert process.posix_memalign(ctypes.byref(out), alignment, 200000) == 0
            assert out.value % alignment == 0, (alignment, out.value)
            process.free(out)
        assert process.posix_memalign(ctypes.byref(out), 24, 100) == 22  # EINVAL: not a power of two
        process.free(grown)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_pool
def test_blocks_from_before_enabling_go_back_to_glibc():
    out = run_probe("""
        early = [process.malloc(size) for size in (100, 8192, 2 * MiB)]
        page_pool.enable(4096)
        before = page_pool.stats()
        for block in early:
            process.free(block)
        late = process.realloc(process.malloc(50), 2 * MiB)  # a glibc block grown past the threshold stays glibc's
        after = page_pool.stats()
        process.free(late)
        print(after.kept_bytes - before.kept_bytes, after.mapped_bytes - before.mapped_bytes)
    """)
    assert out.split() == ["0", "0"]


@needs_pool
def test_many_threads_allocating_at_once_corrupt_nothing():
    out = run_probe("""
        import random, threading
        page_pool.enable(4096)
        errors = []
        def work(seed):
            rng = random.Random(seed)
            held = []
            for _ in range(1500):
                if held and rng.random() < 0.5:
                    pointer, size, byte = held.pop(rng.randrange(len(held)))
                    if ctypes.string_at(pointer, size) != bytes([byte]) * size:
                        errors.append("a block changed under its owner")
                    process.free(pointer)
                else:
                    size = rng.choice([3000, 9000, 65536, 200000, 700000])
                    byte = rng.randrange(256)
                    pointer = process.malloc(size)
                    ctypes.memset(pointer, byte, size)
                    held.append((pointer, size, byte))
            for pointer, _, _ in held:
                process.free(pointer)
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = page_pool.stats()
        print(len(errors), stats.live_bytes < MiB)
    """)
    assert out.split() == ["0", "True"]


@pytest.mark.slow
@needs_pool
def test_torch_trains_on_the_pool():
    out = run_probe("""
        import torch
        from common.blas_threads import guard_blas_threads
        guard_blas_threads()  # as every FedFit process that trains does (NVPL on a Pi 4's core)
        page_pool.enable(4096)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(16 * 26 * 26, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(64, 1, 28, 28), torch.arange(64) % 10
        losses = []
        for step in range(30):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            losses.append(loss.item())
            if step == 9:
                settled = page_pool.stats()
        stats = page_pool.stats()
        assert stats.live_bytes + stats.kept_bytes <= stats.high_water_bytes
        # Every step allocates its activations, their gradients and the optimizer's temporaries anew, each a new
        # mapping under the compact heap; once the pool holds the pattern, most reuse kept pages (x86-64: 0-2
        # mappings of 8-9 blocks a step; emulated aarch64 with oneDNN's ACL convolutions: 3-4 of 10-12).
        blocks, maps = stats.blocks - settled.blocks, stats.maps - settled.maps
        print(losses[0] > 2 * losses[-1], blocks >= 20 and maps <= blocks / 2)
    """)
    assert out.split() == ["True", "True"]


@needs_pool
def test_realloc_grows_and_shrinks_a_block_where_it_lies():
    # Growing by copying would hold both copies at once (the compact heap's mremap never does).
    out = run_probe("""
        from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
        page_pool.enable(4096)
        size = 8 * MiB
        block = process.malloc(size)
        ctypes.memset(block, 0x33, size)
        baseline = rss_bytes(); reset_peak_rss()
        while size < 64 * MiB:
            size += size // 4
            block = process.realloc(block, size)
            ctypes.memset(block, 0x33, size)
        grown_peak = (peak_rss_bytes() - baseline) / MiB
        assert ctypes.string_at(block, size) == b"\\x33" * size
        live_before = page_pool.stats().live_bytes
        block = process.realloc(block, MiB)  # the tail goes back at once
        assert page_pool.stats().live_bytes < live_before - 60 * MiB
        assert ctypes.string_at(block, MiB) == b"\\x33" * MiB
        process.free(block)
        print(grown_peak, size / MiB)
    """)
    peak, final = (float(value) for value in out.split())
    assert peak < final - 8 + 4, out  # one copy of the final block above the first 8 MiB (+ slack), not two


@needs_pool
def test_a_sparse_zeroed_block_stays_unresident():
    out = run_probe("""
        from edge_agent.child import rss_bytes
        page_pool.enable(4096)
        baseline = rss_bytes()
        block = process.calloc(1, 256 * MiB)
        ctypes.memset(block, 1, 4096)  # one page written
        print((rss_bytes() - baseline) / MiB)
        process.free(block)
    """)
    assert float(out) < 16, out


@needs_pool
def test_a_block_written_in_part_is_resident_only_where_written():
    # oneDNN's GEMM convolutions book scratch for every thread they might run and write one part: the pool must
    # not make the rest resident, neither in a kept block grown to the request nor in a fresh mapping. (Pooled
    # from 1 MiB, so that the interpreter's own buffers cannot take the kept block first.)
    out = run_probe("""
        from edge_agent.child import rss_bytes
        page_pool.enable(MiB)
        kept = process.malloc(8 * MiB)
        ctypes.memset(kept, 1, 8 * MiB)
        process.free(kept)  # 8 MiB kept, resident
        baseline = rss_bytes()
        mapped = page_pool.stats().mapped_bytes
        grown = process.malloc(64 * MiB)  # the kept block, grown in place: 56 MiB more mapped
        grown_mapped = page_pool.stats().mapped_bytes - mapped
        ctypes.memset(grown, 2, 4096)
        fresh = process.malloc(128 * MiB)  # nothing is kept now: a fresh mapping
        fresh_mapped = page_pool.stats().mapped_bytes - mapped - grown_mapped
        ctypes.memset(fresh, 3, 4096)
        print((rss_bytes() - baseline) / MiB, grown_mapped / MiB, fresh_mapped / MiB)
        process.free(fresh)
        process.free(grown)
    """)
    resident, grown, fresh = (float(value) for value in out.split())
    assert grown == 56, out  # the kept block was grown, not replaced
    assert 128 <= fresh < 129, out
    assert resident < 16, out  # two written pages (+ the interpreter), not 56 + 128 MiB of unwritten ones


@needs_pool
def test_scratch_written_in_part_counts_as_what_it_wrote():
    # The GEMM pattern: scratch mapped for more than it writes, beside a live block. The high-water mark bounds
    # what is kept in mapped bytes: were the scratch's unwritten 22 MiB counted, the written block freed after it
    # would stay kept (resident) while the next 16 MiB block is written: 24 MiB resident where the live peak is
    # 16. (Pooled from 1 MiB: the interpreter's own buffers stay out of the way.)
    out = run_probe("""
        from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
        page_pool.enable(MiB)
        baseline = rss_bytes(); reset_peak_rss()
        written = process.malloc(8 * MiB)
        ctypes.memset(written, 1, 8 * MiB)
        scratch = process.malloc(24 * MiB)
        ctypes.memset(scratch, 2, 2 * MiB)
        high_water = page_pool.stats().high_water_bytes
        process.free(scratch)
        after = page_pool.stats()
        # Kept, counted as the 2 MiB it wrote, and off the mark: its 22 MiB unwritten (a transparent huge page may
        # have made up to 2 MiB more resident)
        assert after.kept_bytes <= 4 * MiB and after.high_water_bytes <= high_water - 19 * MiB, (high_water, after)
        process.free(written)
        assert page_pool.stats().kept_bytes >= 8 * MiB, page_pool.stats()  # written through: kept
        gradient = process.malloc(16 * MiB)
        ctypes.memset(gradient, 3, 16 * MiB)
        print((peak_rss_bytes() - baseline) / MiB)
        process.free(gradient)
    """)
    assert float(out) <= 16 + 3, out  # the live peak (16 MiB, then 8 + 2), not 16 + the 8 MiB kept (+ huge pages)


@needs_pool
def test_the_obsolete_aligned_allocators_behave_as_glibcs():
    out = run_probe("""
        process.pvalloc.restype = ctypes.c_void_p
        process.pvalloc.argtypes = (ctypes.c_size_t,)
        process.memalign.restype = ctypes.c_void_p
        process.memalign.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
        page_pool.enable(4096)
        assert process.pvalloc(ctypes.c_size_t(-1).value) is None  # no wrap-around to a tiny block
        odd = process.memalign(24, 100)  # glibc rounds the alignment up to a power of two
        assert odd is not None and odd % 32 == 0
        process.free(odd)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_pool
def test_scratch_seen_once_counts_as_what_it_writes():
    # A step: three 8 MiB activations (the live peak, 24 MiB), two freed; scratch of 24 MiB of which 2 are written;
    # two 8 MiB gradients. Counted as its mapped 24 MiB, the scratch made room by evicting both kept activations
    # (and, the mark lowered by what it had not written, the pool stayed short): three new mappings a step. Counted as
    # the 2 MiB it wrote, one kept block goes, and a gradient reuses the other.
    out = run_probe("""
        from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
        page_pool.enable(MiB)
        def step():
            acts = [process.malloc(8 * MiB) for _ in range(3)]
            for block in acts:
                ctypes.memset(block, 1, 8 * MiB)
            for block in acts[1:]:
                process.free(block)
            scratch = process.malloc(24 * MiB)
            ctypes.memset(scratch, 2, 2 * MiB)
            process.free(scratch)
            grads = [process.malloc(8 * MiB) for _ in range(2)]
            for block in grads:
                ctypes.memset(block, 3, 8 * MiB)
            for block in (acts[0], *grads):
                process.free(block)
        step()
        page_pool.release()
        step()
        baseline = rss_bytes(); reset_peak_rss()  # (24 MiB kept: the live peak's pages)
        maps_before = page_pool.stats().maps
        for _ in range(5):
            step()
        print((peak_rss_bytes() - baseline) / MiB, page_pool.stats().maps - maps_before)
    """)
    peak_mib, maps = out.split()
    assert int(maps) <= 2 * 5 + 1, out  # the scratch's fresh pages and one gradient's a step (3 a step before)
    assert float(peak_mib) <= 2, out  # nothing resident above the live peak's 24 MiB (+ headers, the interpreter)
