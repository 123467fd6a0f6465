"""Inference on this CPU: latency and peak memory of every model of an exported folder (``fedfit export``), by
onnxruntime and by torch, and the early-exit trade-off of the models with exits.

    .venv/bin/python benchmarks/inference.py MODEL_DIR [--inputs NPZ] [--plot PNG] [--json OUT]

For each model and backend, in a fresh process (so that one model's memory is not another's): the resident memory
after the runtime is imported and before the model is loaded, the peak (``VmHWM``) after loading it and answering
``--images`` images one at a time, their difference (what the model and its runtime's arena cost), the manifest's
estimate (tensors only: weights and the peak activations of one image), the median milliseconds an image at batch 1
and an image within a batch of 100. For each model with early exits (``--inputs`` with labels): accuracy, mean
multiply-accumulates and milliseconds an image (the median of five passes) at each confidence threshold,
onnxruntime, batches of 100; ``--plot``
draws accuracy against mean MACs per model. Prints a table and one JSON line per measurement. A figure here is this
CPU's, with whatever else it runs: compare ratios, not absolute times, across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.inference import open_model
from common.model_package import read_manifest

THRESHOLDS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.01)
BACKENDS = ("onnxruntime", "torch")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure_one(folder: Path, name: str, backend: str, images: int, x: np.ndarray) -> dict[str, Any]:
    """In this process (a fresh one: see :func:`measure`): memory and latency of model ``name`` by ``backend``."""
    if backend == "onnxruntime":
        import onnxruntime  # noqa: F401 - the runtime's own memory is before the model's
    else:
        import torch

        torch.set_num_threads(1)
    manifest = read_manifest(folder)
    entry = manifest.model(name)
    before = _status_kib("VmRSS")
    runner = open_model(folder, manifest, entry, backend)
    singles = []
    for index in range(images):
        started = time.perf_counter()
        runner.logits(x[index % len(x)][None])
        singles.append(time.perf_counter() - started)
    peak = _status_kib("VmHWM")
    batch = x[:100] if len(x) >= 100 else np.resize(x, (100, *x.shape[1:]))
    runner.logits(batch)
    batched = []
    for _ in range(5):
        started = time.perf_counter()
        runner.logits(batch)
        batched.append((time.perf_counter() - started) / len(batch))
    return {"model": name, "backend": backend, "parameters": entry.parameters, "macs": entry.macs,
            "estimate_mib": entry.inference_bytes / 2**20, "rss_before_mib": before / 1024,
            "peak_mib": peak / 1024, "model_mib": (peak - before) / 1024,
            "ms_batch1": 1000 * statistics.median(singles[1:] or singles),
            "ms_in_batch100": 1000 * statistics.median(batched)}


def measure(folder: Path, name: str, backend: str, images: int, inputs: Path | None) -> dict[str, Any]:
    """:func:`measure_one` in a fresh interpreter."""
    command = [sys.executable, __file__, str(folder), "--one", name, "--backend", backend, "--images", str(images)]
    if inputs is not None:
        command += ["--inputs", str(inputs)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def sweep(folder: Path, name: str, x: np.ndarray, y: np.ndarray) -> list[dict[str, Any]]:
    """Early exit at each of :data:`THRESHOLDS`: accuracy, mean MACs and milliseconds an image (onnxruntime)."""
    manifest = read_manifest(folder)
    entry = manifest.model(name)
    runner = open_model(folder, manifest, entry, "onnxruntime")
    rows = []
    for threshold in THRESHOLDS:
        runner.early_exit(x[:100], threshold)  # warm
        times = []
        for _ in range(5):  # the median of five passes: a loaded machine's pauses aside
            started = time.perf_counter()
            answer = runner.early_exit(x, threshold)
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        rows.append({"model": name, "threshold": threshold,
                     "accuracy": float((answer.logits.argmax(1) == y).mean()),
                     "mean_macs": float(answer.macs.mean()), "ms_per_image": 1000 * seconds / len(x),
                     "exits": np.bincount(answer.exits, minlength=entry.outputs).tolist()})
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == name]
        for axis, key, label in ((axes[0], "mean_macs", "mean multiply-accumulates an image (M)"),
                                 (axes[1], "ms_per_image", "milliseconds an image (onnxruntime, batches of 100)")):
            scale = 1e6 if key == "mean_macs" else 1.0
            axis.plot([row[key] / scale for row in mine], [row["accuracy"] for row in mine], marker="o",
                      label=f"level {name}")
            for row in mine:
                if row["threshold"] in (0.5, 0.9, 0.99):
                    axis.annotate(f"{row['threshold']:g}", (row[key] / scale, row["accuracy"]), fontsize=7)
            axis.set_xlabel(label)
            axis.set_ylabel("test accuracy")
            axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_inputs(path: Path | None, manifest: Any) -> tuple[np.ndarray, np.ndarray | None]:
    if path is None:
        shape = manifest.input.shape
        return np.random.default_rng(0).random((100, *shape), dtype=np.float32), None
    data = np.load(path)
    pixels = data["x"].astype(np.float32)
    if pixels.ndim == 3:
        pixels = pixels[:, None]
    return manifest.input.normalise(pixels), (data["y"] if "y" in data.files else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a model folder fedfit export wrote")
    parser.add_argument("--inputs", type=Path, default=None,
                        help=".npz of test pixels in [0, 1] (x) and labels (y); default: random images, no sweep")
    parser.add_argument("--images", type=int, default=200, help="images answered one at a time (default 200)")
    parser.add_argument("--plot", type=Path, default=None, help="draw the early-exit trade-off here (PNG)")
    parser.add_argument("--title", default="early exit: accuracy against cost")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="onnxruntime", help=argparse.SUPPRESS)
    args = parser.parse_args()
    manifest = read_manifest(args.folder)
    x, y = load_inputs(args.inputs, manifest)
    if args.one is not None:
        print(json.dumps(measure_one(args.folder, args.one, args.backend, args.images, x)))
        return 0
    rows = [measure(args.folder, entry.name, backend, args.images, args.inputs)
            for entry in manifest.models for backend in BACKENDS]
    print(f"{'model':<9} {'backend':<12} {'params':>9} {'MMACs':>7} {'estimate':>8} {'measured':>8} {'peak':>7} "
          f"{'ms (1)':>7} {'ms (in 100)':>11}")
    for row in rows:
        print(f"{row['model']:<9} {row['backend']:<12} {row['parameters']:>9,} {row['macs'] / 1e6:>7.3f} "
              f"{row['estimate_mib']:>7.2f}M {row['model_mib']:>7.2f}M {row['peak_mib']:>6.0f}M "
              f"{row['ms_batch1']:>7.3f} {row['ms_in_batch100']:>11.4f}")
    swept: list[dict[str, Any]] = []
    if y is not None:
        for entry in manifest.models:
            if entry.has_exits:
                swept += sweep(args.folder, entry.name, x, y)
        for row in swept:
            print(f"early exit {row['model']} at {row['threshold']:g}: accuracy {row['accuracy']:.4f}, "
                  f"{row['mean_macs'] / 1e6:.3f} MMACs and {row['ms_per_image']:.4f} ms an image, "
                  f"answered at outputs {row['exits']}")
        if args.plot is not None and swept:
            plot(swept, args.plot, args.title)
    for row in [*rows, *swept]:
        print(json.dumps(row))
    if args.json is not None:
        args.json.write_text(json.dumps({"measured": rows, "early_exit": swept}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
