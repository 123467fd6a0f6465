"""fedfit predict: a model folder answers images and archives, and bad input is one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.data import Dataset
from coordinator.deployable import GLOBAL, TrainedSoFar
from coordinator.deployment import cut_models, write_models
from coordinator.evaluation import Evaluator
from coordinator.tasks import EvalTarget
from fedfit.cli import main
from models import SubmodelSpec, get_family


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = get_family("cnn", 3, 1, hidden=(4, 8))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 1, 8, 8)).astype(np.float32)
    data = Dataset("tiny", x, rng.integers(0, 3, 30), x, rng.integers(0, 3, 30), 3, 1, (8, 8), ("cat", "dog", "owl"),
                   (0.5, 0.25))
    judge = Evaluator.for_test_set(family, data, None, 0, torch.from_numpy(x))
    torch.manual_seed(0)
    targets = {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec(exits=(0,)), store_bn=True)}
    models, _ = cut_models(targets, {GLOBAL: family.build(SubmodelSpec(exits=(0,))).state_dict()}, family, judge,
                           TrainedSoFar(set(), {1, 2}), None)
    path = tmp_path_factory.mktemp("models")
    write_models(path, models, family, data, judge, algorithm="scalefl", family_name="cnn",
                 model_options={"hidden": [4, 8]}, round_number=1, source="test")
    return path


def test_images_and_archives_are_answered(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Image.fromarray(np.full((8, 8), 200, dtype=np.uint8)).save(tmp_path / "one.png")
    np.savez(tmp_path / "two.npz", x=np.zeros((2, 8, 8), dtype=np.uint8), y=np.array([0, 2]))
    assert main(["predict", "--model", str(folder), str(tmp_path / "one.png"), str(tmp_path / "two.npz")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("one.png: ") and "two.npz[1]: " in out and "3 image(s)" in out
    assert "accuracy" not in out  # the image carries no label
    assert main(["predict", "--model", str(folder), str(tmp_path / "two.npz"), "--exit-threshold", "0", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["summary"]["exits"] == {"1": 2, "2": 0} and answer["summary"]["accuracy"] is not None
    assert {row["name"] for row in answer["answers"]} <= {"cat", "dog", "owl"}
    assert [row["output"] for row in answer["answers"]] == [1, 1]


@pytest.mark.parametrize(("arguments", "said"), [
    (["--level", "z"], "no model 'z' here"),
    (["--exit-threshold", "-1"], "--exit-threshold must be a confidence"),
    (["--backend", "torch", "--level", "global"], None),
])
def test_what_it_cannot_run_is_said_in_one_sentence(folder: Path, tmp_path: Path, arguments: list[str],
                                                    said: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "ok.npz", x=np.zeros((1, 8, 8), dtype=np.uint8))
    code = main(["predict", "--model", str(folder), str(tmp_path / "ok.npz"), *arguments])
    assert (code, said is None or said in capsys.readouterr().err) == (2 if said else 0, True)


def test_an_image_of_another_size_is_refused(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "big.npz", x=np.zeros((1, 28, 28), dtype=np.uint8))
    assert main(["predict", "--model", str(folder), str(tmp_path / "big.npz")]) == 2
    assert "the model takes images of 1 x 8 x 8 (channels x height x width), got 1x28x28" in capsys.readouterr().err
