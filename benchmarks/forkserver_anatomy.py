"""The training forkserver's memory by part and by cause.

By part, from the kernel's account of a process's mappings (``/proc/PID/smaps``): anonymous memory (heap,
Python's objects, libraries' ``.bss``) and the file pages of torch's libraries, of the CUDA libraries (torch's
CUDA build and ``cuda.bindings``), of triton, and of the rest (Python, numpy, ...). The *anon* column counts the
pages that exist only in memory (anonymous ones, and file pages copied on write: relocated data); the other
file pages the kernel can read again from their files, and may reclaim.

By cause: a fresh process prepares itself as the forkserver does (``edge_agent.child_warmup.prepare``), once as
the server was before issue 21 (``light=False``) and once as it is now, after loading torch's CPU libraries and
then its CUDA libraries by hand (``dlopen``, as ``import torch`` would) so that each shows on a line of its own;
the table gives the RSS after each step and what the step added. Used by ``benchmarks/footprint.py``; on its
own: ``.venv/bin/python benchmarks/forkserver_anatomy.py`` (about 20 s). Imports nothing heavy before its first
measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from edge_agent import mappings

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
PARTS = ("anonymous", "torch libraries", "CUDA libraries", "triton", "Python, numpy, others")
#: torch's own libraries that exist only in its CUDA build.
TORCH_CUDA_LIBRARIES = ("libtorch_cuda", "libc10_cuda", "libtorch_nvshmem", "libcaffe2_nvrtc")


def part_of(mapping: mappings.Mapping) -> str:
    """Which of :data:`PARTS` a mapping belongs to."""
    path = mapping.path
    if not mapping.file_backed:
        return "anonymous"
    if "/triton/" in path:
        return "triton"
    if ("/nvidia/" in path or "/site-packages/cuda/" in path
            or os.path.basename(path).startswith(TORCH_CUDA_LIBRARIES)):
        return "CUDA libraries"
    if "/torch/" in path:
        return "torch libraries"
    return "Python, numpy, others"


def by_part(pid: int | str = "self") -> dict[str, tuple[int, int]]:
    """(RSS, anonymous) bytes of each of :data:`PARTS` of process ``pid``, and of all of them (``"total"``)."""
    sums = {part: [0, 0] for part in (*PARTS, "total")}
    for mapping in mappings.read(pid):
        for key in (part_of(mapping), "total"):
            sums[key][0] += mapping.rss
            sums[key][1] += mapping.anonymous
    return {part: (rss, anon) for part, (rss, anon) in sums.items()}


def print_parts(parts: dict[str, tuple[int, int]], indent: str = "  ") -> None:
    """One process's parts: RSS and anonymous MiB."""
    print(f"{indent}{'forkserver by part':<30} {'RSS MiB':>10} {'anon MiB':>10}")
    for part in (*PARTS, "total"):
        rss, anon = parts[part]
        print(f"{indent}{part:<30} {rss / MIB:>10.1f} {anon / MIB:>10.1f}")


def prepare_in_steps(mode: str) -> None:
    """This process prepared as the forkserver (``mode``: ``before`` or ``now``), one JSON line per step with the
    RSS and anonymous bytes of every part."""
    def step(name: str) -> None:
        print(json.dumps({"step": name, "parts": by_part()}), flush=True)

    step("python")
    import numpy  # noqa: F401

    step("numpy")
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations is not None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    step("torch's CPU libraries loaded")
    if (lib / "libtorch_cuda.so").exists():
        ctypes.CDLL(str(lib / "libtorch_cuda.so"), mode=ctypes.RTLD_GLOBAL)
        step("CUDA libraries loaded")
    from edge_agent.child_warmup import prepare

    prepare(step, light=mode == "now")


def anatomy() -> dict[str, list[dict]]:
    """Both preparations, each in a fresh process: ``{mode: [{"step", "parts"}, ...]}``."""
    runs = {}
    for mode in ("before", "now"):
        out = subprocess.run([sys.executable, __file__, "--steps", mode], cwd=ROOT, capture_output=True, text=True,
                             timeout=600, check=True).stdout
        runs[mode] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return runs


def print_anatomy(runs: dict[str, list[dict]]) -> None:
    """The two preparations side by side: RSS after each step, what it added, of that anonymous; then by
    part."""
    cells: dict[str, dict[str, tuple[int, int, int]]] = {mode: {} for mode in runs}
    for mode, records in runs.items():
        previous = (0, 0)
        for record in records:
            rss, anon = record["parts"]["total"]
            cells[mode][record["step"]] = (rss, rss - previous[0], anon - previous[1])
            previous = (rss, anon)
    names = [record["step"] for record in runs["now"]]
    names += [record["step"] for record in runs["before"] if record["step"] not in names]
    names.sort(key=lambda name: min(index for mode in runs for index, record in enumerate(runs[mode])
                                    if record["step"] == name))
    print("\nforkserver anatomy: a fresh process prepared as the server was (before) and is (now); MiB")
    print(f"{'step':<34} {'before RSS':>10} {'+added':>8} {'anon':>8} {'now RSS':>10} {'+added':>8} {'anon':>8}")
    for name in names:
        row = f"{name:<34}"
        for mode in ("before", "now"):
            if name in cells[mode]:
                rss, added, added_anon = cells[mode][name]
                row += f" {rss / MIB:>10.1f} {added / MIB:>+8.1f} {added_anon / MIB:>+8.1f}"
            else:
                row += f" {'-':>10} {'':>8} {'':>8}"
        print(row)
    print(f"\n{'the prepared server by part':<34} {'before RSS':>10} {'anon':>8} {'now RSS':>10} {'anon':>8}")
    for part in (*PARTS, "total"):
        before, now = runs["before"][-1]["parts"][part], runs["now"][-1]["parts"][part]
        print(f"{part:<34} {before[0] / MIB:>10.1f} {before[1] / MIB:>8.1f} {now[0] / MIB:>10.1f} "
              f"{now[1] / MIB:>8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", choices=("before", "now"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps:
        prepare_in_steps(args.steps)
    else:
        print_anatomy(anatomy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
