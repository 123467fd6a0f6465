"""Loading training data kept on an edge device: an ``.npz`` file or a folder of class sub-folders."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from common.data.errors import DatasetError

__all__ = ["IMAGE_SUFFIXES", "load_local_data"]

#: File suffixes (lower case) read as images in a class folder.
IMAGE_SUFFIXES: frozenset[str] = frozenset({".png", ".jpg", ".jpeg"})
_GRAY_MODES = frozenset({"1", "L", "LA", "La"})
_GRAY16_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def _scale_images(x: np.ndarray, where: str) -> np.ndarray:
    """uint8 (or any integer array within 0..255) -> /255; floats unchanged; float32 N x C x H x W."""
    if x.ndim == 3:
        x = x[:, None, :, :]
    elif x.ndim != 4:
        raise DatasetError(f"{where}: 'x' has shape {x.shape}; it must be N x H x W or N x C x H x W.")
    if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DatasetError(f"{where}: 'x' has dtype {x.dtype}; store images as uint8 (0..255) or float.")
    if np.issubdtype(x.dtype, np.integer):
        if x.size and (int(x.min()) < 0 or int(x.max()) > 255):
            raise DatasetError(
                f"{where}: integer 'x' values must lie in 0..255, found {int(x.min())}..{int(x.max())}; "
                "store images as uint8 or float."
            )
        return np.ascontiguousarray(x, dtype=np.float32) / np.float32(255.0)
    out = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(out).all():
        raise DatasetError(f"{where}: 'x' contains NaN or infinite values; fix or drop those samples.")
    return out


def _check_labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    if y.ndim != 1:
        raise DatasetError(f"{where}: 'y' has shape {y.shape}; it must be a 1-D array of N labels.")
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{where}: 'y' has dtype {y.dtype}; labels must be integers.")
    if len(y) != n:
        raise DatasetError(f"{where}: 'x' holds {n} samples but 'y' holds {len(y)} labels; they must match.")
    if y.size and int(y.min()) < 0:
        raise DatasetError(f"{where}: labels must be >= 0, found {int(y.min())}.")
    return np.ascontiguousarray(y, dtype=np.int64)


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    where = f"Local data file {str(path)!r}"
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise DatasetError(
            f"{where} is not an .npz archive of plain arrays ({exc}); re-create it with numpy.savez."
        ) from exc
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(
            f"{where} is not a readable .npz archive ({exc}); re-create it with numpy.savez."
        ) from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DatasetError(f"{where} holds a single array, not an .npz archive; save it with numpy.savez.")
    try:
        with loaded as npz:
            keys = set(npz.files)
            if not {"x", "y"} <= keys:
                raise DatasetError(
                    f"{where} must hold arrays named 'x' and 'y', found {sorted(keys)}; "
                    "save it with numpy.savez(path, x=images, y=labels)."
                )
            x = npz["x"]
            y = npz["y"]
    except DatasetError:
        raise
    except ValueError as exc:
        raise DatasetError(
            f"{where} holds object arrays, which are refused since loading them means unpickling ({exc}); "
            "save plain numeric arrays."
        ) from exc
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(
            f"{where} is not a readable .npz archive ({exc}); re-create it with numpy.savez."
        ) from exc
    images = _scale_images(x, where)
    if len(images) == 0:
        raise DatasetError(f"{where} holds no samples; add some data.")
    return images, _check_labels(y, len(images), where)


def _decode_image(file: Path) -> np.ndarray:
    """Decode one image to a float32 C x H x W array in [0, 1]; grayscale stays one channel."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as img:
            img.load()
            mode = img.mode
            arr: Any
            if mode in _GRAY_MODES:
                arr = np.asarray(img.convert("L"), dtype=np.float32)[None] / np.float32(255.0)
            elif mode in _GRAY16_MODES:
                arr = np.asarray(img, dtype=np.float32)[None] / np.float32(65535.0)
            elif mode in ("I", "F"):
                raise DatasetError(
                    f"Image {str(file)!r} uses the 32-bit pixel mode {mode!r}; save it as 8-bit PNG or JPEG."
                )
            else:
                arr = np.asarray(img.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / np.float32(255.0)
    except DatasetError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise DatasetError(
            f"Image {str(file)!r} could not be decoded ({exc}); replace or remove it."
        ) from exc
    return np.ascontiguousarray(arr, dtype=np.float32)


def _load_folder(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read ``root/<label>/<image>``; entries whose name starts with '.' are ignored."""
    classes: list[tuple[int, Path]] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if not entry.is_dir() or not entry.name.isdecimal():
            raise DatasetError(
                f"Local data folder {str(root)!r} contains {entry.name!r}; it must hold only sub-folders "
                "named by their integer class label (0, 1, ...), each with PNG or JPEG images."
            )
        classes.append((int(entry.name), entry))
    classes.sort()
    images: list[np.ndarray] = []
    labels: list[int] = []
    first: Path | None = None
    for label, folder in classes:
        for file in sorted(folder.iterdir()):
            if file.name.startswith("."):
                continue
            if not file.is_file() or file.suffix.lower() not in IMAGE_SUFFIXES:
                raise DatasetError(
                    f"{str(file)!r} is not a PNG or JPEG image; class folders may hold only .png, .jpg or "
                    ".jpeg files, so move it elsewhere."
                )
            img = _decode_image(file)
            if first is None:
                first = file
            elif img.shape != images[0].shape:
                raise DatasetError(
                    f"Image {str(file)!r} has shape {img.shape} (channels x height x width) but "
                    f"{str(first)!r} has {images[0].shape}; all images must share size and colour mode."
                )
            images.append(img)
            labels.append(label)
    if not images:
        raise DatasetError(
            f"Local data folder {str(root)!r} holds no images; add class sub-folders (0, 1, ...) with PNG or "
            "JPEG files."
        )
    return np.stack(images).astype(np.float32, copy=False), np.asarray(labels, dtype=np.int64)


def load_local_data(
    path: str | Path, normalize: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Load a device's own training data.

    ``path`` is either an ``.npz`` file with arrays ``x`` (``N x H x W`` or ``N x C x H x W``; uint8 0..255 or
    float) and ``y`` (``N`` non-negative integer labels), read with allow_pickle=False; or a folder with one sub-folder
    per class, named by its integer label, holding PNG/JPEG images of one size (grayscale stays one channel;
    dot-files are ignored).

    Returns float32 ``N x C x H x W`` images (uint8 scaled to [0, 1], floats unchanged), then
    ``(x - mean) / std`` when ``normalize=(mean, std)`` is given, and int64 labels.

    Raises
    ------
    DatasetError
        For a missing path or any malformed content.
    """
    p = Path(path).expanduser()
    if normalize is not None:
        mean, std = normalize
        if not (math.isfinite(mean) and math.isfinite(std)) or std <= 0:
            raise DatasetError(f"normalize=(mean, std) needs finite values and std > 0, got {normalize!r}.")
    if p.is_dir():
        x, y = _load_folder(p)
    elif p.is_file():
        if p.suffix.lower() != ".npz":
            raise DatasetError(
                f"Local data file {str(p)!r} is not an .npz archive; give an .npz file with arrays 'x' and "
                "'y' or a folder of class sub-folders."
            )
        x, y = _load_npz(p)
    else:
        raise DatasetError(
            f"Local data path {str(p)!r} does not exist; give an .npz file or a folder of class sub-folders."
        )
    if normalize is not None:
        x = (x - np.float32(normalize[0])) / np.float32(normalize[1])
    return np.ascontiguousarray(x, dtype=np.float32), y
