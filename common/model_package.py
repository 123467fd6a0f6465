"""A run's deployable models on disk: a folder with ``manifest.json`` and the files it names.

Written by whoever cuts the models from a run (``fedfit export``, the coordinator at the end of a federation) and read
by whoever runs one (an agent storing the one that fits it, ``fedfit predict``). Per model: its ONNX graph (the
whole model, images in, its answer's logits out), its stages between early exits (one ONNX graph each, where it
has exits), and its weights in safetensors with the spec to build it in torch; each file with its sha256, checked
before it is used. JSON and safetensors only: nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.durable import write_atomic

__all__ = ["FORMAT", "MANIFEST", "InputSpec", "Manifest", "ManifestError", "ModelEntry", "ModelFile",
           "manifest_from_dict", "manifest_to_dict", "read_manifest", "read_verified", "sha256_of", "write_file",
           "write_manifest"]

FORMAT = "fedfit-models-v1"
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A model folder cannot be used: the message says which file and why, in one sentence."""


def sha256_of(data: bytes) -> str:
    """The hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ModelFile:
    """A file of the folder: its path relative to the folder, sha256 and size."""

    path: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class InputSpec:
    """What a model takes: float32 images ``N x channels x height x width``, each ``(p - mean) / std`` of its
    pixels ``p`` scaled to [0, 1]."""

    channels: int
    height: int
    width: int
    mean: float
    std: float

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)``."""
        return (self.channels, self.height, self.width)

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """``pixels`` (``N x C x H x W`` in [0, 1]) as the model takes them; ValueError (one sentence) when their
        shape is not the model's."""
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != self.shape:
            raise ValueError(f"the model takes images of {self.channels} x {self.height} x {self.width} (channels x "
                             f"height x width), got {'x'.join(map(str, pixels.shape[1:])) or 'a scalar'}")
        return ((pixels.astype(np.float32) - np.float32(self.mean)) / np.float32(self.std)).astype(np.float32)


@dataclass(frozen=True)
class ModelEntry:
    """One deployable model of a run (a level, or the global model), as exported.

    ``answer`` is ``"last"`` (the logits of its last output) or ``"ensemble"`` (the mean of the logits of the
    outputs ``members``, 0-based); ``exit_macs[i]`` the multiply-accumulates of one image up to and including output
    ``i`` (early-exit inference stops there); ``accuracy`` the run's own figure for it (its last round's report),
    ``exit_accuracy`` each output's (the ensemble's last where it has one) measured on the same test images at
    export; ``trained``: some device trained it (an untrained one is exported only when asked);
    ``inference_bytes``: the tensors a forward pass of one image holds at its peak (weights included)."""

    name: str
    spec: dict[str, Any]
    parameters: int
    macs: int
    outputs: int
    answer: str
    members: tuple[int, ...]
    exit_macs: tuple[int, ...]
    accuracy: float | None
    exit_accuracy: tuple[float, ...]
    trained: bool
    deployed: bool
    inference_bytes: int
    onnx: ModelFile
    state: ModelFile
    stages: tuple[ModelFile, ...] = ()
    #: The run's other names for the same model (a level that is the global model).
    aliases: tuple[str, ...] = ()

    @property
    def has_exits(self) -> bool:
        """Whether inference can stop before its last output (its stages are exported)."""
        return self.outputs > 1 and len(self.stages) == self.outputs


@dataclass(frozen=True)
class Manifest:
    """The folder's models and what they share: the method and model they come from, the round they were cut at,
    their input and the class names."""

    algorithm: str
    family: str
    model_options: dict[str, Any]
    num_classes: int
    round: int
    source: str
    input: InputSpec
    classes: tuple[str, ...]
    models: tuple[ModelEntry, ...]
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    def model(self, name: str) -> ModelEntry:
        """The model ``name``; ManifestError (one sentence) naming the ones there are."""
        for entry in self.models:
            if name == entry.name or name in entry.aliases:
                return entry
        raise ManifestError(f"no model {name!r} here; the folder holds {', '.join(e.name for e in self.models)}")

    def deployed(self) -> ModelEntry:
        """The run's deployable model (its headline), or the largest trained one when it was not exported."""
        chosen = [entry for entry in self.models if entry.deployed] or self.largest_trained()
        if not chosen:
            raise ManifestError("the folder holds no trained model")
        return chosen[0]

    def largest_trained(self, budget_bytes: int | None = None) -> list[ModelEntry]:
        """The trained models (within ``budget_bytes`` of inference memory, when given), the largest first (by
        parameters; of two as large, the run's deployable one: DepthFL's ensemble before its deepest classifier)."""
        fitting = [entry for entry in self.models if entry.trained
                   and (budget_bytes is None or entry.inference_bytes <= budget_bytes)]
        return sorted(fitting, key=lambda entry: (-entry.parameters, not entry.deployed, entry.name))

    def for_budget(self, budget_bytes: int) -> ModelEntry | None:
        """The largest trained model a device with ``budget_bytes`` of memory for inference can run, None when
        none fits."""
        fitting = self.largest_trained(budget_bytes)
        return fitting[0] if fitting else None


def _file(raw: Any, where: str) -> ModelFile:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("path"), str) or not isinstance(raw.get("sha256"), str):
        raise ManifestError(f"{where}: a file entry needs a path and a sha256, got {raw!r}")
    path = raw["path"]
    if Path(path).is_absolute() or ".." in Path(path).parts:
        raise ManifestError(f"{where}: file {path!r} is not inside the folder")
    return ModelFile(path, raw["sha256"], int(raw.get("bytes", 0)))


def _entry(raw: Any, where: str) -> ModelEntry:
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{where}: a model entry must be a mapping, got {type(raw).__name__}")
    try:
        accuracy = raw.get("accuracy")
        entry = ModelEntry(
            name=str(raw["name"]), spec=dict(raw["spec"]), parameters=int(raw["parameters"]), macs=int(raw["macs"]),
            outputs=int(raw["outputs"]), answer=str(raw["answer"]), members=tuple(int(m) for m in raw["members"]),
            exit_macs=tuple(int(m) for m in raw["exit_macs"]),
            accuracy=None if accuracy is None else float(accuracy),
            exit_accuracy=tuple(float(a) for a in raw["exit_accuracy"]), trained=bool(raw["trained"]),
            deployed=bool(raw["deployed"]), inference_bytes=int(raw["inference_bytes"]),
            onnx=_file(raw["onnx"], where), state=_file(raw["state"], where),
            stages=tuple(_file(stage, where) for stage in raw.get("stages", ())),
            aliases=tuple(str(alias) for alias in raw.get("aliases", ())))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{where}: model entry {raw.get('name', '?')!r} is damaged ({exc!r})") from None
    if entry.answer not in ("last", "ensemble") or entry.outputs < 1 or len(entry.exit_macs) != entry.outputs:
        raise ManifestError(f"{where}: model {entry.name!r} has an answer {entry.answer!r}, {entry.outputs} outputs "
                            f"and {len(entry.exit_macs)} exit costs; they must agree")
    return entry


def manifest_from_dict(raw: Any, where: str = MANIFEST) -> Manifest:
    """A :class:`Manifest` from its JSON form; ManifestError (one sentence) for anything missing or wrong."""
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{where} is not a JSON object")
    if raw.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a FedFit model folder's manifest (format {raw.get('format')!r}, "
                            f"expected {FORMAT!r})")
    try:
        spec = raw["input"]
        image = InputSpec(int(spec["channels"]), int(spec["height"]), int(spec["width"]), float(spec["mean"]),
                          float(spec["std"]))
        if not (math.isfinite(image.mean) and math.isfinite(image.std)) or image.std <= 0:
            raise ManifestError(f"{where}: the input's mean and std must be finite and std positive")
        models = tuple(_entry(entry, where) for entry in raw["models"])
        manifest = Manifest(str(raw["algorithm"]), str(raw["family"]), dict(raw.get("model_options", {})),
                            int(raw["num_classes"]), int(raw["round"]), str(raw.get("source", "")), image,
                            tuple(str(name) for name in raw["classes"]), models, extra=dict(raw.get("extra", {})))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{where} is damaged: {exc!r}") from None
    if not manifest.models:
        raise ManifestError(f"{where} names no model")
    if len({entry.name for entry in manifest.models}) != len(manifest.models):
        raise ManifestError(f"{where} names a model twice")
    return manifest


def manifest_to_dict(manifest: Manifest) -> dict[str, Any]:
    """The JSON form of ``manifest``."""
    return asdict(manifest)


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write ``folder``'s manifest atomically (the files it names are written first); its path."""
    path = Path(folder) / MANIFEST
    write_atomic(path, (json.dumps(manifest_to_dict(manifest), indent=1) + "\n").encode())
    return path


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of the model folder ``folder``; ManifestError (one sentence) when there is none or it is
    damaged."""
    path = Path(folder) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{folder} holds no {MANIFEST}: give a folder `fedfit export` wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from None
    return manifest_from_dict(raw, str(path))


def read_verified(folder: str | Path, file: ModelFile) -> bytes:
    """The bytes of ``file`` in ``folder``, checked against its sha256; ManifestError (one sentence) when it is
    missing or altered."""
    path = Path(folder) / file.path
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
    if sha256_of(data) != file.sha256:
        raise ManifestError(f"{path} does not match its digest in the manifest: it was altered or cut short")
    return data


def write_file(folder: str | Path, relative: str, data: bytes) -> ModelFile:
    """Write ``data`` to ``folder/relative`` atomically (its parents made) and describe it for the manifest."""
    path = Path(folder) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return ModelFile(relative, sha256_of(data), len(data))
