"""Whether an exported model answers the same on this machine as on the one that exported it (aarch64 under
emulation against x86-64: ``benchmarks/arm64_check.sh --parts predict``).

``--make DIR`` (on the exporting machine): trains a small CNN with two early exits on the digits for a few epochs,
writes it as a model folder (``coordinator.deployment``: ONNX and safetensors, the manifest), the test images as
``inputs.npz`` (pixels in [0, 1]) and ``reference.json``: each image's logits, by onnxruntime and by torch, whole and
with early exit at a confidence of 0.9. ``--check DIR`` (on the other machine): the same through this machine's
onnxruntime and torch, compared: PASS when every image gets the same class and output with both backends and no
logit differs by more than 1e-3, except where an image's top two classes are within that of each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.inference import open_model
from common.model_package import read_manifest

THRESHOLD = 0.9
TOLERANCE = 1e-3
BACKENDS = ("onnxruntime", "torch")


def answers(folder: Path, pixels: np.ndarray) -> dict[str, dict[str, list]]:
    """Per backend: the whole model's logits, and early exit's logits and outputs."""
    manifest = read_manifest(folder)
    entry = manifest.deployed()
    x = manifest.input.normalise(pixels)
    found = {}
    for backend in BACKENDS:
        runner = open_model(folder, manifest, entry, backend)
        early = runner.early_exit(x, THRESHOLD)
        found[backend] = {"logits": runner.logits(x).tolist(), "early": early.logits.tolist(),
                          "exits": early.exits.tolist()}
    return found


def make(folder: Path) -> None:
    import torch

    from common.data import load_dataset
    from coordinator.deployable import GLOBAL, TrainedSoFar
    from coordinator.deployment import cut_models, write_models
    from coordinator.evaluation import Evaluator
    from coordinator.tasks import EvalTarget
    from models import SubmodelSpec, get_family

    digits = load_dataset("digits")
    family = get_family("cnn", 10, 1, hidden=(16, 32, 64))
    spec = SubmodelSpec(exits=(0, 1))
    torch.manual_seed(0)
    net = family.build(spec)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.tensor(digits.x_train), torch.tensor(digits.y_train)
    for _ in range(5):
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = sum(torch.nn.functional.cross_entropy(out, y[start:start + 32])
                       for out in net.forward_exits(x[start:start + 32]))
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
    judge = Evaluator.for_test_set(family, digits, None, 0, x)
    targets = {GLOBAL: EvalTarget(GLOBAL, spec, store_bn=True)}
    models, _ = cut_models(targets, {GLOBAL: net.state_dict()}, family, judge, TrainedSoFar(set(), {1, 2, 3}), None)
    write_models(folder, models, family, digits, judge, algorithm="scalefl", family_name="cnn",
                 model_options={"hidden": [16, 32, 64]}, round_number=1, source="same_predictions.py")
    mean, std = digits.normalization
    pixels = (digits.x_test * std + mean).astype(np.float32)
    np.savez(folder / "inputs.npz", x=pixels, y=digits.y_test)
    (folder / "reference.json").write_text(json.dumps(answers(folder, pixels)))
    print(json.dumps({"made": str(folder), "images": len(pixels)}))


def differences(mine: np.ndarray, theirs: np.ndarray) -> tuple[float, int]:
    """The largest logit difference, and the images whose class differs though their top two are not within
    :data:`TOLERANCE` of each other."""
    top2 = np.sort(theirs, axis=1)[:, -2:]
    close = (top2[:, 1] - top2[:, 0]) <= TOLERANCE
    flipped = (mine.argmax(1) != theirs.argmax(1)) & ~close
    return float(np.abs(mine - theirs).max()), int(flipped.sum())


def check(folder: Path) -> int:
    reference = json.loads((folder / "reference.json").read_text())
    pixels = np.load(folder / "inputs.npz")["x"]
    found = answers(folder, pixels)
    result: dict[str, object] = {}
    ok = True
    for backend in BACKENDS:
        whole, flipped = differences(np.asarray(found[backend]["logits"]), np.asarray(reference[backend]["logits"]))
        early, early_flipped = differences(np.asarray(found[backend]["early"]), np.asarray(reference[backend]["early"]))
        exits_moved = int((np.asarray(found[backend]["exits"]) != np.asarray(reference[backend]["exits"])).sum())
        result[backend] = {"max_logit_difference": whole, "classes_changed": flipped,
                           "early_max_logit_difference": early, "early_classes_changed": early_flipped,
                           "exits_moved": exits_moved}
        ok = ok and whole <= TOLERANCE and flipped == 0 and early_flipped == 0 and exits_moved == 0
    result["result"] = "PASS" if ok else "FAIL"
    print(json.dumps(result))
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", type=Path, help="write the model folder, inputs and reference answers here")
    parser.add_argument("--check", type=Path, help="answer here and compare with the folder's reference")
    args = parser.parse_args()
    if args.make is not None:
        make(args.make)
        return 0
    if args.check is not None:
        return check(args.check)
    parser.error("give --make DIR or --check DIR")
    return 2


if __name__ == "__main__":
    sys.exit(main())
