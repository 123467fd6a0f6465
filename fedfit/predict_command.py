"""``fedfit predict --model DIR INPUT...``: run an exported model (``fedfit export``, or the one an agent stored) on
images or ``.npz`` archives, on this device: onnxruntime where it is installed, torch otherwise.

The model is the folder's deployable one unless ``--level`` names another. With ``--exit-threshold T`` a model with
early exits stops, image by image, at the first output whose answer has a softmax confidence of at least T
(:mod:`common.inference`) and says which output answered. Prints each image's class (the first ``--show``), then
how many there were, the accuracy where the inputs carry labels, the mean multiply-accumulates and the time per
image. Imports torch only where it runs the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """The ``predict`` sub-command's arguments."""
    predict = sub.add_parser(
        "predict", help="run an exported model on images or .npz archives",
        description="Run an exported model (fedfit export's folder, or an agent's stored model) on images (.png, "
                    ".jpg) or .npz archives (x, and optionally y: the accuracy is printed), with onnxruntime where "
                    "installed, else torch.")
    predict.add_argument("inputs", nargs="+", metavar="INPUT", help="image files or .npz archives")
    predict.add_argument("--model", required=True, metavar="DIR", help="the model folder (holding manifest.json)")
    predict.add_argument("--level", default=None, metavar="NAME",
                         help="the model of the folder to run (default: the run's deployable one)")
    predict.add_argument("--exit-threshold", type=float, default=None, metavar="T",
                         help="early exit: stop at the first output whose softmax confidence is at least T (0-1; a "
                              "model without exits answers at its one output)")
    predict.add_argument("--backend", choices=("auto", "onnxruntime", "torch"), default="auto",
                         help="what runs the model (default: onnxruntime where installed, else torch)")
    predict.add_argument("--show", type=int, default=20, metavar="N",
                         help="print the answers of the first N images (default 20; all with --json)")
    predict.add_argument("--json", action="store_true", help="print one JSON object: every answer and the summary")


def run(args: argparse.Namespace) -> int:
    """Predict and print; 0 on success."""
    from common.data.inputs import read_inputs
    from common.inference import open_model
    from common.model_package import read_manifest

    threshold = args.exit_threshold
    if threshold is not None and not 0.0 <= threshold:
        raise ValueError(f"--exit-threshold must be a confidence from 0 to 1 (above 1: never exit early), got "
                         f"{threshold:g}")
    manifest = read_manifest(args.model)
    entry = manifest.model(args.level) if args.level else manifest.deployed()
    inputs = read_inputs(args.inputs)
    x = manifest.input.normalise(inputs.pixels)
    runner = open_model(args.model, manifest, entry, args.backend)
    started = time.perf_counter()
    if threshold is None:
        logits = runner.logits(x)
        exits = np.full(len(x), entry.outputs - 1, dtype=np.int64)
        macs = np.full(len(x), entry.macs, dtype=np.int64)
    else:
        answer = runner.early_exit(x, threshold)
        logits, exits, macs = answer.logits, answer.exits, answer.macs
    seconds = time.perf_counter() - started
    predicted = logits.argmax(axis=1)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    confidence = 1.0 / shifted.sum(axis=1)
    summary: dict[str, Any] = {
        "model": entry.name, "backend": runner.backend, "images": len(x),
        "accuracy": float((predicted == inputs.labels).mean()) if inputs.labels is not None else None,
        "mean_macs": float(macs.mean()), "ms_per_image": 1000.0 * seconds / max(1, len(x)),
        "exit_threshold": threshold,
        "exits": {str(number + 1): int((exits == number).sum()) for number in range(entry.outputs)}
        if threshold is not None and runner.has_exits else None}
    answers = [{"input": name, "class": int(label), "name": manifest.classes[int(label)],
                "confidence": round(float(conf), 4), "output": int(out) + 1}
               for name, label, conf, out in zip(inputs.names, predicted, confidence, exits)]
    if args.json:
        print(json.dumps({"answers": answers, "summary": summary}))
        return 0
    for row in answers[:max(0, args.show)]:
        where = f"  (output {row['output']} of {entry.outputs})" if summary["exits"] is not None else ""
        print(f"{row['input']}: {row['name']} ({row['class']}), confidence {row['confidence']:.3f}{where}")
    if len(answers) > args.show > 0:
        print(f"... and {len(answers) - args.show} more")
    line = (f"{entry.name} by {runner.backend}: {len(x)} image(s), {summary['ms_per_image']:.3f} ms and "
            f"{summary['mean_macs'] / 1e6:.3f} M multiply-accumulates an image")
    if summary["accuracy"] is not None:
        line += f", accuracy {summary['accuracy']:.4f}"
    if summary["exits"] is not None:
        line += "; answered at output " + ", ".join(f"{k}: {v}" for k, v in summary["exits"].items())
    print(line, file=sys.stdout)
    return 0
