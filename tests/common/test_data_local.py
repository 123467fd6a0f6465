"""Tests for common.data.local.load_local_data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.data import DatasetError, load_local_data


def save_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def save_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


# --- npz ------------------------------------------------------------------------------------------------


def test_npz_uint8_three_dims(tmp_path: Path) -> None:
    x = np.full((4, 5, 6), 255, dtype=np.uint8)
    x[0] = 0
    path = save_npz(tmp_path / "d.npz", x=x, y=np.array([0, 1, 2, 1], dtype=np.int32))
    xs, ys = load_local_data(path)
    assert xs.shape == (4, 1, 5, 6) and xs.dtype == np.float32
    assert ys.dtype == np.int64 and ys.tolist() == [0, 1, 2, 1]
    assert float(xs[0].max()) == 0.0 and float(xs[1].min()) == 1.0


def test_npz_float_four_dims_unchanged_and_normalized(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((3, 3, 4, 4)).astype(np.float64)
    path = save_npz(tmp_path / "d.npz", x=x, y=np.array([2, 0, 1]))
    xs, _ = load_local_data(str(path))
    assert xs.shape == (3, 3, 4, 4)
    np.testing.assert_allclose(xs, x.astype(np.float32))
    xn, _ = load_local_data(path, normalize=(0.5, 0.25))
    np.testing.assert_allclose(xn, (x.astype(np.float32) - 0.5) / 0.25, rtol=1e-5)


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"images": np.zeros((2, 3, 3)), "y": np.zeros(2, dtype=int)}, "named 'x' and 'y'"),
        ({"x": np.zeros((2, 3, 3)), "y": np.zeros(3, dtype=int)}, "2 samples but 'y' holds 3"),
        ({"x": np.zeros((2, 3, 3)), "y": np.array([0, -1])}, ">= 0"),
        ({"x": np.zeros((2, 3, 3)), "y": np.array([0.0, 1.0])}, "labels must be integers"),
        ({"x": np.zeros((2, 3, 3)), "y": np.zeros((2, 1), dtype=int)}, "1-D"),
        ({"x": np.zeros((2, 3)), "y": np.zeros(2, dtype=int)}, "N x H x W"),
        ({"x": np.zeros((0, 3, 3)), "y": np.zeros(0, dtype=int)}, "no samples"),
        ({"x": np.full((1, 2, 2), 300, dtype=np.int16), "y": np.zeros(1, dtype=int)}, "0..255"),
        ({"x": np.full((1, 2, 2), np.nan), "y": np.zeros(1, dtype=int)}, "NaN"),
        ({"x": np.array([[["a"]]]), "y": np.zeros(1, dtype=int)}, "dtype"),
    ],
)
def test_npz_rejections(tmp_path: Path, arrays: dict[str, np.ndarray], fragment: str) -> None:
    path = save_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError, match="bad.npz") as info:
        load_local_data(path)
    assert fragment in str(info.value)


def test_npz_object_arrays_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"evil": 1}], dtype=object), y=np.zeros(1, dtype=int))
    with pytest.raises(DatasetError, match="pickle"):
        load_local_data(path)


def test_npz_not_an_archive(tmp_path: Path) -> None:
    path = tmp_path / "junk.npz"
    path.write_bytes(b"definitely not a zip file")
    with pytest.raises(DatasetError, match="junk.npz"):
        load_local_data(path)


def test_single_npy_named_npz(tmp_path: Path) -> None:
    path = tmp_path / "single.npz"
    with path.open("wb") as fh:
        np.save(fh, np.zeros(3))
    with pytest.raises(DatasetError, match="single array"):
        load_local_data(path)


def test_missing_path_and_wrong_suffix(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_local_data(tmp_path / "missing.npz")
    other = tmp_path / "data.csv"
    other.write_text("1,2,3\n")
    with pytest.raises(DatasetError, match="not an .npz archive"):
        load_local_data(other)


def test_bad_normalize(tmp_path: Path) -> None:
    path = save_npz(tmp_path / "d.npz", x=np.zeros((1, 2, 2)), y=np.zeros(1, dtype=int))
    with pytest.raises(DatasetError, match="std > 0"):
        load_local_data(path, normalize=(0.5, 0.0))


# --- folder ---------------------------------------------------------------------------------------------


def test_folder_grayscale(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "0" / "a.png", np.zeros((6, 5), dtype=np.uint8))
    save_png(root / "0" / "b.png", np.full((6, 5), 255, dtype=np.uint8))
    save_png(root / "3" / "c.png", np.full((6, 5), 51, dtype=np.uint8))
    (root / ".hidden").write_text("ignored")
    (root / "3" / ".DS_Store").write_bytes(b"\0")
    x, y = load_local_data(root)
    assert x.shape == (3, 1, 6, 5) and x.dtype == np.float32
    assert y.dtype == np.int64 and y.tolist() == [0, 0, 3]
    assert float(x[0].max()) == 0.0 and float(x[1].min()) == 1.0
    assert float(x[2, 0, 0, 0]) == pytest.approx(0.2)
    xn, _ = load_local_data(root, normalize=(0.5, 0.5))
    assert float(xn[1].min()) == pytest.approx(1.0) and float(xn[0].max()) == pytest.approx(-1.0)


def test_folder_rgb_and_jpeg(tmp_path: Path) -> None:
    root = tmp_path / "data"
    rgb = np.zeros((4, 4, 3), dtype=np.uint8)
    rgb[..., 0] = 255
    save_png(root / "1" / "red.png", rgb)
    (root / "2").mkdir()
    Image.fromarray(rgb).save(root / "2" / "red.JPG", quality=95)
    x, y = load_local_data(root)
    assert x.shape == (2, 3, 4, 4)
    assert y.tolist() == [1, 2]
    assert float(x[0, 0].min()) == 1.0 and float(x[0, 1:].max()) == 0.0
    assert float(x[1, 0].mean()) > 0.9


def test_folder_label_order_is_numeric(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for label in (10, 2):
        save_png(root / str(label) / "a.png", np.zeros((2, 2), dtype=np.uint8))
    assert load_local_data(root)[1].tolist() == [2, 10]


def test_folder_non_image_file(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "0" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    (root / "0" / "notes.txt").write_text("hello")
    with pytest.raises(DatasetError, match="notes.txt") as info:
        load_local_data(root)
    assert "not a PNG or JPEG" in str(info.value)


def test_folder_undecodable_image(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "0").mkdir(parents=True)
    (root / "0" / "broken.png").write_bytes(b"not really a png")
    with pytest.raises(DatasetError, match="broken.png") as info:
        load_local_data(root)
    assert "could not be decoded" in str(info.value)


def test_folder_bad_class_name(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "cats" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    with pytest.raises(DatasetError, match="'cats'"):
        load_local_data(root)


def test_folder_stray_file_at_top(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "0" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    (root / "README").write_text("x")
    with pytest.raises(DatasetError, match="'README'"):
        load_local_data(root)


def test_folder_mixed_sizes(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "0" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    save_png(root / "1" / "b.png", np.zeros((4, 3), dtype=np.uint8))
    with pytest.raises(DatasetError, match="b.png") as info:
        load_local_data(root)
    assert "share size" in str(info.value)


def test_folder_mixed_channels(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_png(root / "0" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    save_png(root / "0" / "b.png", np.zeros((3, 3, 3), dtype=np.uint8))
    with pytest.raises(DatasetError, match="b.png"):
        load_local_data(root)


def test_folder_without_images(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "0").mkdir(parents=True)
    with pytest.raises(DatasetError, match="holds no images"):
        load_local_data(root)
