"""common.model_package: a model folder's manifest read back as written, and every damage said in one sentence."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from common.model_package import (
    InputSpec,
    Manifest,
    ManifestError,
    ModelEntry,
    manifest_to_dict,
    read_manifest,
    read_verified,
    write_file,
    write_manifest,
)


def entry(name: str, parameters: int, memory: int, *, folder: Path, trained: bool = True,
          deployed: bool = False) -> ModelEntry:
    file = write_file(folder, f"{name}/model.onnx", name.encode())
    return ModelEntry(name, {"width": 1.0}, parameters, 10 * parameters, 1, "last", (), (10 * parameters,), 0.5,
                      (0.5,), trained, deployed, memory, file, file)


def manifest(folder: Path, *entries: ModelEntry) -> Manifest:
    return Manifest("heterofl", "cnn", {"hidden": [4, 8, 8]}, 10, 5, "run", InputSpec(1, 8, 8, 0.3, 0.2),
                    tuple(str(i) for i in range(10)), entries)


def test_a_manifest_reads_back_as_written(tmp_path: Path) -> None:
    written = manifest(tmp_path, entry("a", 100, 5000, deployed=True, folder=tmp_path),
                       entry("b", 50, 2000, folder=tmp_path))
    write_manifest(tmp_path, written)
    assert read_manifest(tmp_path) == written
    assert read_manifest(tmp_path).model("b").parameters == 50


def test_the_largest_trained_model_within_a_budget(tmp_path: Path) -> None:
    models = manifest(tmp_path, entry("a", 100, 5000, trained=False, folder=tmp_path),
                      entry("b", 50, 2000, deployed=True, folder=tmp_path), entry("c", 20, 900, folder=tmp_path))
    assert models.for_budget(10_000).name == "b"  # a is larger but untrained
    assert models.for_budget(1999).name == "c" and models.for_budget(100) is None
    assert models.deployed().name == "b"
    # Of two as large, the run's deployable one (DepthFL's ensemble before its deepest classifier alone).
    tie = manifest(tmp_path, entry("4", 50, 2000, folder=tmp_path), entry("ensemble", 50, 2000, deployed=True,
                                                                            folder=tmp_path))
    assert tie.for_budget(10_000).name == "ensemble"
    with pytest.raises(ManifestError, match="no model 'z' here; the folder holds a, b, c"):
        models.model("z")


def test_an_altered_file_is_refused(tmp_path: Path) -> None:
    file = write_file(tmp_path, "a/model.onnx", b"graph")
    assert read_verified(tmp_path, file) == b"graph"
    (tmp_path / "a" / "model.onnx").write_bytes(b"graph!")
    with pytest.raises(ManifestError, match="does not match its digest"):
        read_verified(tmp_path, file)
    (tmp_path / "a" / "model.onnx").unlink()
    with pytest.raises(ManifestError, match="cannot read"):
        read_verified(tmp_path, file)


def test_damaged_manifests_are_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="holds no manifest.json"):
        read_manifest(tmp_path)
    good = manifest_to_dict(manifest(tmp_path, entry("a", 100, 5000, folder=tmp_path)))

    def refused(change: dict, match: str) -> None:
        (tmp_path / "manifest.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ManifestError, match=match):
            read_manifest(tmp_path)

    refused({"format": "other"}, "not a FedFit model folder")
    refused({"models": []}, "names no model")
    refused({"input": {"channels": 1}}, "damaged")
    refused({"input": {**good["input"], "std": 0}}, "std positive")
    outside = {**good["models"][0], "onnx": {"path": "../x.onnx", "sha256": "0", "bytes": 1}}
    refused({"models": [outside]}, "not inside the folder")
    refused({"models": [good["models"][0], good["models"][0]]}, "names a model twice")
    refused({"models": [{**good["models"][0], "answer": "vote"}]}, "must agree")
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ManifestError, match="cannot read"):
        read_manifest(tmp_path)


def test_images_are_normalised_as_the_model_was_trained() -> None:
    spec = InputSpec(1, 2, 2, 0.5, 0.25)
    assert spec.normalise(np.ones((1, 1, 2, 2), dtype=np.float32)).tolist() == [[[[2.0, 2.0], [2.0, 2.0]]]]
    with pytest.raises(ValueError, match="takes images of 1 x 2 x 2 .* got 1x3x3"):
        spec.normalise(np.ones((1, 1, 3, 3)))


def test_an_entry_without_stages_has_no_exits(tmp_path: Path) -> None:
    single = entry("a", 10, 10, folder=tmp_path)
    assert not single.has_exits and not replace(single, outputs=2, exit_macs=(1, 2)).has_exits
