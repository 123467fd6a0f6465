"""common.data.inputs: images and .npz archives read for a model, in order, with labels where all carry them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.data import DatasetError
from common.data.inputs import read_inputs


def test_images_and_archives_in_order_with_their_labels(tmp_path: Path) -> None:
    Image.fromarray(np.full((4, 4), 255, dtype=np.uint8)).save(tmp_path / "white.png")
    np.savez(tmp_path / "two.npz", x=np.zeros((2, 4, 4), dtype=np.uint8), y=np.array([3, 4]))
    np.savez(tmp_path / "floats.npz", x=np.full((1, 1, 4, 4), 0.5, dtype=np.float32))
    read = read_inputs([tmp_path / "white.png", tmp_path / "two.npz"])
    assert read.pixels.shape == (3, 1, 4, 4) and read.pixels[0].min() == 1.0 and read.pixels[1:].max() == 0.0
    assert read.names == ["white.png", "two.npz[0]", "two.npz[1]"] and read.labels is None  # the image has none
    labelled = read_inputs([tmp_path / "two.npz", tmp_path / "two.npz"])
    assert labelled.labels.tolist() == [3, 4, 3, 4]
    assert read_inputs([tmp_path / "floats.npz"]).pixels.max() == 0.5


def test_bad_inputs_are_refused_in_one_sentence(tmp_path: Path) -> None:
    np.savez(tmp_path / "small.npz", x=np.zeros((1, 4, 4), dtype=np.uint8))
    np.savez(tmp_path / "large.npz", x=np.zeros((1, 5, 5), dtype=np.uint8))
    np.savez(tmp_path / "nox.npz", images=np.zeros((1, 4, 4)))
    (tmp_path / "notes.txt").write_text("x")
    for paths, match in (([], "at least one input"), ([tmp_path / "none.png"], "is not a file"),
                         ([tmp_path / "notes.txt"], "neither an image"), ([tmp_path / "nox.npz"], "no array 'x'"),
                         ([tmp_path / "small.npz", tmp_path / "large.npz"], "holds images of 1x5x5")):
        with pytest.raises(DatasetError, match=match):
            read_inputs(paths)
