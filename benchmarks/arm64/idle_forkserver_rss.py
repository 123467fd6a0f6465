"""The idle training forkserver's resident memory, as an agent that trains on the CPU starts it.

Starts the forkserver the way the agent does (``edge_agent.forkserver``: ``declare_device("cpu")``, ``start()``),
runs one trivial child through it (which waits until the server has imported torch and warmed up: ``start()``
returns as soon as the server process exists), waits ``--settle-s`` seconds, and prints its RSS by part (``benchmarks/forkserver_anatomy.by_part``) and the
kernel's VmRSS/VmHWM. Used by ``benchmarks/arm64_check.sh``; runs anywhere (``.venv/bin/python
benchmarks/arm64/idle_forkserver_rss.py``). Under qemu-user the figures include the emulator's own memory and its
translated code, so they are not a Pi's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.forkserver
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from forkserver_anatomy import MIB, PARTS, by_part

from common.cores import available_cores
from edge_agent import forkserver


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` field in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-s", type=float, default=5.0)
    args = parser.parse_args()
    forkserver.declare_device("cpu")
    forkserver.declare_threads(available_cores())  # an agent's default torch_threads
    started = time.monotonic()
    forkserver.start()
    with tempfile.TemporaryDirectory() as workdir:  # pathlib.Path(workdir): a child that does nothing
        end = forkserver.run_child(forkserver.ChildEntry("pathlib", "Path"), Path(workdir), timeout=900)
    start_s = time.monotonic() - started
    if end.exitcode != 0:
        print(f"the trivial child failed: exit {end.exitcode}", file=sys.stderr)
        return 1
    time.sleep(args.settle_s)
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    parts = by_part(pid)
    print(f"forkserver pid {pid}: started in {start_s:.1f} s; VmRSS {status_kib(pid, 'VmRSS') / 1024:.1f} MiB, "
          f"VmHWM {status_kib(pid, 'VmHWM') / 1024:.1f} MiB")
    for part in (*PARTS, "total"):
        rss, anon = parts[part]
        print(f"  {part:<24} RSS {rss / MIB:8.1f} MiB  anon {anon / MIB:8.1f} MiB")
    print(json.dumps({"idle_forkserver_rss_mib": round(parts["total"][0] / MIB, 1), "start_s": round(start_s, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
