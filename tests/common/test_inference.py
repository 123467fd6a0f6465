"""common.inference: an exported model's answer, and early exit stopping each image at its first confident output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.inference import open_model, softmax_confidence
from common.model_package import Manifest, ManifestError
from coordinator.deployable import GLOBAL, TrainedSoFar
from coordinator.deployment import cut_models, write_models
from coordinator.evaluation import Evaluator
from coordinator.tasks import EvalTarget
from models import SubmodelSpec, get_family

FAMILY = get_family("cnn", 10, 1, hidden=(4, 8, 8))
EXITS = SubmodelSpec(exits=(0, 1))
TARGETS = {GLOBAL: EvalTarget(GLOBAL, EXITS, store_bn=True),
           "narrow": EvalTarget(GLOBAL, SubmodelSpec(width=0.5)),
           "ensemble": EvalTarget(GLOBAL, EXITS, ensemble=True)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, Manifest, np.ndarray, dict[str, list[np.ndarray]]]:
    """A folder of three models (exits, none, an ensemble of outputs 2 and 3), images, and each model's outputs on
    them."""
    from common.data import Dataset

    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 1, 8, 8)).astype(np.float32)
    data = Dataset("tiny", x, rng.integers(0, 10, 50), x, rng.integers(0, 10, 50), 10, 1, (8, 8))
    torch.manual_seed(0)
    state = {name: value * 4 if name.endswith("weight") else value  # confident logits, for a spread of exits
             for name, value in FAMILY.build(EXITS).state_dict().items()}
    judge = Evaluator.for_test_set(FAMILY, data, None, 0, torch.from_numpy(x))
    models, _ = cut_models(TARGETS, {GLOBAL: state}, FAMILY, judge, TrainedSoFar({"narrow"}, {2, 3}), None)
    path = tmp_path_factory.mktemp("models")
    manifest = write_models(path, models, FAMILY, data, judge, algorithm="depthfl", family_name="cnn",
                            model_options={"hidden": [4, 8, 8]}, round_number=1, source="test")
    with torch.no_grad():
        outputs = {m.name: [out.numpy() for out in m.net.forward_exits(torch.from_numpy(x))] for m in models}
    return path, manifest, x, outputs


def test_confidence_is_the_top_class_softmax_probability() -> None:
    logits = np.random.default_rng(1).normal(size=(6, 10)).astype(np.float32) * 5
    np.testing.assert_allclose(softmax_confidence(logits), torch.softmax(torch.from_numpy(logits), 1).max(1).values,
                               rtol=1e-5)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_each_image_stops_at_its_first_confident_output(folder, backend: str) -> None:
    path, manifest, images, outputs = folder
    entry = manifest.model(GLOBAL)
    runner = open_model(path, manifest, entry, backend)
    whole = runner.early_exit(images, threshold=1.5)  # never confident enough: the whole model
    np.testing.assert_allclose(whole.logits, runner.logits(images), atol=1e-5)
    assert (whole.exits == 2).all() and (whole.macs == entry.exit_macs[-1]).all()
    first = runner.early_exit(images, threshold=0.0)
    np.testing.assert_allclose(first.logits, outputs[GLOBAL][0], atol=1e-4)
    assert (first.exits == 0).all() and (first.macs == entry.exit_macs[0]).all()
    threshold = float(np.median(softmax_confidence(outputs[GLOBAL][0])))
    mixed = runner.early_exit(images, threshold)
    for index in range(len(images)):
        confident = [softmax_confidence(out[index:index + 1])[0] >= threshold for out in outputs[GLOBAL]]
        stop = confident.index(True) if True in confident[:-1] else 2
        assert mixed.exits[index] == stop
        np.testing.assert_allclose(mixed.logits[index], outputs[GLOBAL][stop][index], atol=1e-4)
    assert 0 < (mixed.exits == 0).sum() < len(images)


def test_an_ensemble_answers_with_the_mean_of_its_members_reached(folder) -> None:
    path, manifest, images, outputs = folder
    entry = manifest.model("ensemble")
    assert entry.members == (1, 2) and entry.answer == "ensemble"
    runner = open_model(path, manifest, entry)
    first = runner.early_exit(images, 0.0)  # output 1 is no member: the first answer is output 2's
    assert (first.exits == 1).all()
    np.testing.assert_allclose(first.logits, outputs["ensemble"][1], atol=1e-4)
    whole = runner.early_exit(images, 2.0)
    np.testing.assert_allclose(whole.logits, (outputs["ensemble"][1] + outputs["ensemble"][2]) / 2, atol=1e-4)
    np.testing.assert_allclose(whole.logits, runner.logits(images), atol=1e-4)


def test_a_model_without_exits_answers_at_its_one_output(folder) -> None:
    path, manifest, _, _ = folder
    runner = open_model(path, manifest, manifest.model("narrow"))
    images = np.zeros((3, 1, 8, 8), dtype=np.float32)
    answer = runner.early_exit(images, 0.0)
    assert not runner.has_exits and (answer.exits == 0).all()
    np.testing.assert_allclose(answer.logits, runner.logits(images))


def test_an_unknown_backend_or_an_altered_file_is_refused(folder, tmp_path: Path) -> None:
    path, manifest, _, _ = folder
    with pytest.raises(ValueError, match="backend must be one of"):
        open_model(path, manifest, manifest.model("narrow"), "tensorrt")
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / manifest.model("narrow").onnx.path).write_bytes(b"not a graph")
    with pytest.raises(ManifestError, match="does not match its digest"):
        open_model(copy, manifest, manifest.model("narrow"), "onnxruntime")
