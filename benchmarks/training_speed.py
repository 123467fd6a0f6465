"""Training speed and peak memory of each heap arrangement, side by side, in one run.

Run as ``.venv/bin/python benchmarks/training_speed.py`` (a benchmark: it prints, it never fails on a number). For
every row (model family, width, batch size) and every heap arrangement it trains the sub-model the way the edge
agent's training child does (``edge_agent.child``: one warm-up step of a throwaway copy at the task's shapes, the
heap settled, the RSS high-water mark reset, then the model built and trained through ``models.train``), each in
a fresh process so no arrangement inherits another's heap, and prints milliseconds per step, the measured peak
above the baseline, the step time's ratio to glibc's defaults and the estimate's ratio to the peak (the estimate
of ``models.memory`` for the ``pooled`` and ``compact`` heaps, which counts the live tensors and the convolutions'
copies, no heap retention).

Arrangements (those whose library is not installed, or cannot be built, are listed and skipped):

``default``     glibc untouched.
``pooled``      the edge agent's default: ``compact`` with FedFit's page pool preloaded (``edge_agent.page_pool``),
                which keeps freed blocks' pages for reuse within the live high-water mark.
``compact``     glibc, every block of a page or more mapped and unmapped on its own (``edge_agent.allocator``).
``compact+thp`` ``compact`` with torch's transparent-huge-page allocations (``THP_MEM_ALLOC_ENABLE=1``: blocks
                of 2 MiB or more aligned to 2 MiB and advised ``MADV_HUGEPAGE``), so those fault in 2 MiB at a time.
``tcmalloc``    gperftools' tcmalloc (Debian ``libtcmalloc-minimal4``) preloaded, never releasing during training
                (``TCMALLOC_RELEASE_RATE=0``), released before the baseline.
``jemalloc``    jemalloc (Debian ``libjemalloc2``) preloaded, no decay, no oversize arena, purged before the
                baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1e6
NUM_CLASSES = 10
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib/arm-linux-gnueabihf",
                "/usr/lib64", "/usr/lib")


@dataclass(frozen=True)
class Arrangement:
    name: str
    env: dict[str, str]
    preload: str = ""  # a library file name to preload, looked up in LIBRARY_DIRS
    glibc: str = "default"  # the edge agent's allocator word applied in the process (edge_agent.allocator)

    def library(self) -> str | None:
        if not self.preload:
            return ""
        if self.preload == PAGE_POOL:
            from edge_agent import page_pool

            path = page_pool.library_path()
            return str(path) if path is not None else None
        found = [str(Path(d) / self.preload) for d in LIBRARY_DIRS if (Path(d) / self.preload).exists()]
        return found[0] if found else None


PAGE_POOL = "the page pool"  # built by edge_agent.page_pool, not looked up in LIBRARY_DIRS

ARRANGEMENTS = (
    Arrangement("default", {}),
    Arrangement("pooled", {}, preload=PAGE_POOL, glibc="pooled"),
    Arrangement("compact", {}, glibc="compact"),
    Arrangement("compact+thp", {"THP_MEM_ALLOC_ENABLE": "1"}, glibc="compact"),
    Arrangement("tcmalloc", {"TCMALLOC_RELEASE_RATE": "0"}, preload="libtcmalloc_minimal.so.4"),
    Arrangement("jemalloc", {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1,oversize_threshold:0"},
                preload="libjemalloc.so.2"),
)


@dataclass(frozen=True)
class Row:
    family: str
    width: float
    batch_size: int
    in_channels: int = 1
    image_size: tuple[int, int] = (28, 28)

    def label(self) -> str:
        return f"{self.family} width={self.width:g}"


ROWS = (
    Row("cnn", 1.0, 32), Row("cnn", 1.0, 128), Row("cnn", 0.25, 32),
    Row("preresnet20", 1.0, 32), Row("preresnet20", 0.5, 32), Row("resnet20", 1.0, 32),
    Row("preresnet18", 0.5, 32, 3, (32, 32)),
)


def release_preloaded_heap() -> None:
    """Give a preloaded malloc's free memory back to the system (what ``malloc_trim`` does for glibc)."""
    preload = os.environ.get("LD_PRELOAD", "")
    process = ctypes.CDLL(None)
    if "tcmalloc" in preload:
        process.MallocExtension_ReleaseFreeMemory()
    elif "jemalloc" in preload:
        mallctl = process.mallctl
        mallctl.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        if mallctl(b"arena.4096.purge", None, None, None, 0) != 0:  # 4096: every arena
            raise RuntimeError("jemalloc refused to purge its arenas")


def measure(row: Row, glibc: str, steps: int, threads: int) -> dict[str, float]:
    """Train ``row`` as the training child does, in this process; its ms per step and peak above the baseline."""
    import torch

    from edge_agent import allocator as heap
    from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes, warm_up_training
    from models import SubmodelSpec, get_family, train
    from protocol import LossTerm, OptimizerSettings, TrainingPlan

    torch.set_num_threads(threads)
    heap.configure(glibc)
    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    spec = SubmodelSpec(width=row.width)
    plan = TrainingPlan(optimizer=OptimizerSettings("sgd", 0.01, 0.9, 5e-4, 1.0), epochs=1,
                        batch_size=row.batch_size, loss=(LossTerm.ce(),))
    torch.manual_seed(0)
    samples = steps * row.batch_size
    x = torch.randn(samples, row.in_channels, *row.image_size)
    y = torch.arange(samples) % NUM_CLASSES
    labels = list(range(NUM_CLASSES))
    warm_up_training(lambda: family.build(spec, track_bn_stats=False), spec, x, y, plan, labels, NUM_CLASSES,
                     "cpu", glibc)
    gc.collect()
    release_preloaded_heap()
    baseline = rss_bytes()
    reset_peak_rss()
    model = family.build(spec, track_bn_stats=False)
    cpu = os.times()
    result = train(model, spec, x, y, plan, labels=labels, num_classes=NUM_CLASSES)
    after = os.times()
    return {"ms_per_step": 1000 * result.seconds / result.steps, "peak_bytes": float(peak_rss_bytes() - baseline),
            "system_share": (after.system - cpu.system) / max(1e-9, (after.system - cpu.system)
                                                              + (after.user - cpu.user))}


def estimate(row: Row) -> int:
    from models import SubmodelSpec, estimate_plan_memory, get_family
    from protocol import TrainingPlan

    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    return estimate_plan_memory(family, SubmodelSpec(width=row.width), TrainingPlan(batch_size=row.batch_size),
                                input_size=row.image_size, allocator="pooled").total


def run_one(row: Row, arrangement: Arrangement, library: str, steps: int, threads: int) -> dict[str, float]:
    """:func:`measure` in a fresh process with ``arrangement``'s environment."""
    env = {**os.environ, **arrangement.env}
    if library:
        env["LD_PRELOAD"] = library
    command = [sys.executable, __file__, "--measure", json.dumps([row.family, row.width, row.batch_size,
                                                                  row.in_channels, list(row.image_size)]),
               "--glibc", arrangement.glibc, "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"{arrangement.name} on {row.label()}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per measurement (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--match", default="", help="only rows whose 'family width=W' contains this text")
    parser.add_argument("--arrangements", default=",".join(a.name for a in ARRANGEMENTS),
                        help="comma-separated arrangements to measure (default: all)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one row, in this process
    parser.add_argument("--glibc", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        family, width, batch, channels, size = json.loads(args.measure)
        print(json.dumps(measure(Row(family, width, batch, channels, tuple(size)), args.glibc, args.steps,
                                 args.threads)))
        return

    wanted = [name.strip() for name in args.arrangements.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {a.name for a in ARRANGEMENTS})
    if unknown:
        parser.error(f"unknown arrangement(s): {', '.join(unknown)}")
    chosen = []
    for arrangement in (a for a in ARRANGEMENTS if a.name in wanted):
        library = arrangement.library()
        if library is None:
            print(f"{arrangement.name}: {arrangement.preload} is not available here; skipped")
        else:
            chosen.append((arrangement, library))
    rows = [row for row in ROWS if args.match in row.label()]
    started = time.monotonic()
    print(f"{'family':12s} {'spec':10s} {'batch':>5s} {'arrangement':12s} {'ms/step':>8s} {'x default':>9s} "
          f"{'peak MB':>8s} {'est/peak':>8s} {'sys %':>6s}")
    worst: dict[str, tuple[float, float]] = {}
    for row in rows:
        predicted = estimate(row)
        base_ms = None
        for arrangement, library in chosen:
            measured = run_one(row, arrangement, library, args.steps, args.threads)
            ms = measured["ms_per_step"]
            base_ms = ms if arrangement.name == "default" else base_ms
            speed = ms / base_ms if base_ms else 0.0
            ratio = predicted / measured["peak_bytes"] if measured["peak_bytes"] > 0 else float("inf")
            slow, off = worst.get(arrangement.name, (0.0, 1.0))
            worst[arrangement.name] = (max(slow, speed), ratio if abs(ratio - 1) > abs(off - 1) else off)
            print(f"{row.family:12s} {'w=' + format(row.width, 'g'):10s} {row.batch_size:5d} {arrangement.name:12s} "
                  f"{ms:8.1f} {format(speed, '.2f') if base_ms else '-':>9s} {measured['peak_bytes'] / MB:8.2f} {ratio:8.3f} "
                  f"{100 * measured['system_share']:6.1f}", flush=True)
    print(f"({len(rows)} rows x {len(chosen)} arrangements, {args.steps} steps each, {args.threads} thread(s), "
          f"{time.monotonic() - started:.0f} s)")
    for name, (slow, off) in worst.items():
        speed = f"slowest {slow:.2f} x default" if base_ms is not None else "no default row to compare speeds"
        print(f"{name}: {speed}, estimate/peak farthest from 1: {off:.3f}")


if __name__ == "__main__":
    main()
