"""Images to run a model on: image files (PNG, JPEG) and ``.npz`` archives of arrays ``x`` (and, optionally, their
labels ``y``), read as float32 ``N x C x H x W`` pixels in [0, 1] (uint8 pixels divided by 255, floats as they
are). Nothing is unpickled."""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.data.errors import DatasetError
from common.data.local import IMAGE_SUFFIXES, _check_labels, _decode_image, _scale_images

__all__ = ["Inputs", "read_inputs"]


class Inputs:
    """Images read from files: ``pixels`` (``N x C x H x W`` in [0, 1]), a name for each (its file, and its index in
    an archive), and every label where each input carried them (None otherwise)."""

    def __init__(self, pixels: np.ndarray, names: list[str], labels: np.ndarray | None) -> None:
        self.pixels = pixels
        self.names = names
        self.labels = labels


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    where = f"input {str(path)!r}"
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "x" not in npz.files:
                raise DatasetError(f"{where} holds no array 'x' (it has {sorted(npz.files)}); save the images "
                                   f"with numpy.savez(path, x=images[, y=labels])")
            x = _scale_images(npz["x"], where)
            y = _check_labels(npz["y"], len(x), where) if "y" in npz.files else None
            if not len(x):
                raise DatasetError(f"{where} holds no images")
    except DatasetError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, AttributeError) as exc:
        raise DatasetError(f"{where} is not a readable .npz archive of plain arrays ({exc})") from None
    return x, y


def read_inputs(paths: Sequence[str | Path]) -> Inputs:
    """The images of ``paths`` in order; DatasetError (one sentence) for a file that is missing, of another kind,
    or whose images differ in size from the others'."""
    if not paths:
        raise DatasetError("give at least one input: an image (.png, .jpg) or an .npz archive")
    chunks: list[np.ndarray] = []
    names: list[str] = []
    labels: list[np.ndarray | None] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise DatasetError(f"input {str(path)!r} is not a file")
        suffix = path.suffix.lower()
        if suffix == ".npz":
            x, y = _read_npz(path)
            names += [f"{path.name}[{index}]" for index in range(len(x))]
        elif suffix in IMAGE_SUFFIXES:
            x, y = _decode_image(path)[None], None
            names.append(path.name)
        else:
            raise DatasetError(f"input {str(path)!r} is neither an image (.png, .jpg, .jpeg) nor an .npz archive")
        if chunks and x.shape[1:] != chunks[0].shape[1:]:
            raise DatasetError(f"input {str(path)!r} holds images of {'x'.join(map(str, x.shape[1:]))} (channels x "
                               f"height x width), the inputs before it {'x'.join(map(str, chunks[0].shape[1:]))}")
        chunks.append(x)
        labels.append(y)
    known = None if any(y is None for y in labels) else np.concatenate([y for y in labels if y is not None])
    return Inputs(np.concatenate(chunks), names, known)
