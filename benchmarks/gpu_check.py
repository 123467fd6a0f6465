"""Does FedFit train on this machine's GPU? The check a person with an NVIDIA GPU (or a Jetson) runs, one command:

    .venv/bin/python benchmarks/gpu_check.py            # every part (a few minutes)
    .venv/bin/python benchmarks/gpu_check.py --quick    # without the memory rows

Each part prints what it saw and a verdict (PASS or FAIL); the last line is ``gpu check: N passed, M failed``
and the exit status is 1 when a part failed. It is a benchmark, not a test: it never runs in ``make test``.

1. ``forkserver``: an agent's runner (``edge_agent.runner.TaskRunner``) trains one task with ``device: cuda``
   and one with ``device: cpu`` through the same training forkserver, which must hold no CUDA of its own (no
   ``libcuda`` mapped: a CUDA started before the fork is unusable in the children) while its children train on
   the GPU; the CUDA child reports its context's cost.
2. ``federation cuda`` and ``federation cpu``: a coordinator and two agents over mosquitto (``fedfit sim``,
   HeteroFL, the CNN, digits, 2 rounds), each in a process of its own so that its forkserver starts as a
   deployment's would: 0 failed tasks, and every task trained.
3. ``memory``: the CUDA rows of ``benchmarks/memory.py`` (estimate against the CUDA allocator's peak the
   agent measures); every ratio within 15%.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: How far an estimate may be from the measured CUDA peak (the issue's bar).
MEMORY_TOLERANCE = 0.15


def _load_memory_benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("fedfit_memory_benchmark", ROOT / "benchmarks" / "memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _verdict(name: str, ok: bool, detail: str) -> bool:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return ok


def check_forkserver() -> bool:
    """Part 1: a CUDA task and a CPU task through one forkserver that holds no CUDA itself."""
    import multiprocessing.forkserver

    from edge_agent import forkserver, gpu_stack

    bench = _load_memory_benchmark()
    row = bench.Row("cnn", 1, (28, 28), 1.0, 32)
    forkserver.declare_device("cuda")
    results: dict[str, dict[str, float] | None] = {}
    with tempfile.TemporaryDirectory(prefix="fedfit-gpu-check-") as state_dir:
        for device in ("cuda", "cpu"):
            started = time.monotonic()
            try:
                metrics = bench.measure_with_agent(row, device, 10, 1, "pooled", Path(state_dir) / device)
            except RuntimeError as exc:
                print(f"  {device}: {exc}")
                results[device] = None
                continue
            results[device] = metrics
            print(f"  {device}: trained, peak {metrics['peak_bytes'] / 1e6:.2f} MB, "
                  f"{metrics['seconds'] / metrics['steps'] * 1000:.1f} ms/step, child {time.monotonic() - started:.1f} s"
                  + (f", CUDA context {metrics['cuda_context_bytes'] / 2**20:.0f} MiB"
                     if "cuda_context_bytes" in metrics else ""))
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    maps = Path(f"/proc/{server}/maps").read_text() if server else ""
    held = gpu_stack.gpu_files_open(server) if server else ["(no server)"]
    print(f"  forkserver {server}: CUDA's library {'loaded' if 'libcuda.so' in maps else 'not loaded'}, GPU device "
          f"files open: {', '.join(held) or 'none'} (CUDA started: {'yes' if held else 'no'})")
    ok = all(results.values()) and not held
    return _verdict("forkserver", ok, "a cuda and a cpu task trained, no CUDA in the server" if ok
                    else "see above")


def check_federation(device: str, rounds: int = 2) -> bool:
    """Part 2: a coordinator and two agents over mosquitto, training on ``device``."""
    with tempfile.TemporaryDirectory(prefix=f"fedfit-gpu-check-{device}-") as work:
        run_dir = Path(work) / "run"
        command = [sys.executable, "-m", "fedfit.cli", "sim", "--algorithm", "heterofl", "--agents", "2",
                   "--rounds", str(rounds), "--dataset", "digits", "--model", "cnn", "--seed", "0",
                   "--device", device, "--run-dir", str(run_dir)]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
        seconds = time.monotonic() - started
        report_path = run_dir / "report.json"
        if done.returncode != 0 or not report_path.exists():
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            return _verdict(f"federation {device}", False, f"fedfit sim exited {done.returncode}")
        report = json.loads(report_path.read_text())
    tasks = report["tasks"]
    statuses = report["summary"]["tasks"]
    failed = [task for task in tasks if task["status"] == "failed"]
    for task in failed[:4]:
        print(f"  failed: round {task['round']} {task['agent']}: {task['reason']}")
    accuracy = report["summary"]["final_global_accuracy"]
    trained_on = report["settings"].get("device")
    print(f"  {len(tasks)} tasks {statuses}, final accuracy {accuracy:.4f}, trained on {trained_on}, "
          f"{seconds:.0f} s")
    ok = not failed and report["summary"]["trained"] == len(tasks) and trained_on == device
    return _verdict(f"federation {device}", ok, f"{len(failed)} failed of {len(tasks)}")


def check_memory(steps: int, cudnn_cap: int | None = None) -> bool:
    """Part 3: the CUDA rows of the memory benchmark, each ratio within :data:`MEMORY_TOLERANCE` (``cudnn_cap``:
    cuDNN's convolution workspace capped at that many MiB, ``memory.py --cudnn-workspace-cap``)."""
    cap = ["--cudnn-workspace-cap", str(cudnn_cap)] if cudnn_cap is not None else []
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--device", "cuda",
                           "--steps", str(steps), *cap], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          check=False)
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr[-3000:])
        return _verdict("memory", False, f"benchmarks/memory.py exited {done.returncode}")
    ratios = [float(match.group(1)) for match in re.finditer(r"^cuda .*?\s(\d+\.\d{3})\s+\d+\s", done.stdout, re.MULTILINE)]
    off = [ratio for ratio in ratios if abs(ratio - 1) > MEMORY_TOLERANCE]
    return _verdict("memory", bool(ratios) and not off,
                    f"{len(ratios)} CUDA rows, ratios {min(ratios, default=0):.3f}-{max(ratios, default=0):.3f}, "
                    f"{len(off)} beyond {MEMORY_TOLERANCE:.0%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave the memory rows out")
    parser.add_argument("--steps", type=int, default=10, help="training steps of each memory row (default 10)")
    parser.add_argument("--cudnn-workspace-cap", type=int, default=None, metavar="MIB",
                        help="the memory rows with cuDNN's convolution workspace capped at MIB MiB")
    args = parser.parse_args(argv)
    if args.cudnn_workspace_cap is not None and (args.cudnn_workspace_cap < 0 or args.quick):
        parser.error("--cudnn-workspace-cap takes MiB, 0 or more, and the memory rows (not --quick)")
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"GPU: {os.environ.get('CUDA_VISIBLE_DEVICES', 'all visible')}", flush=True)
    verdicts = [check_forkserver(), check_federation("cuda"), check_federation("cpu")]
    if not args.quick:
        verdicts.append(check_memory(args.steps, args.cudnn_workspace_cap))
    passed = sum(verdicts)
    print(f"gpu check: {passed} passed, {len(verdicts) - passed} failed")
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
