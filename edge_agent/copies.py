"""The device's own auxiliary models for mutual distillation (m-FeDepth): kept between rounds, never sent.

A plan with ``copies`` M > 1 trains the task's model and M - 1 further models of the same spec side by side;
only the first is uploaded. The others belong to this device: they start from a random initialisation the
first time a model and spec are trained this way, and continue from where the last such task left them. They
are stored per model and spec in the agent's state directory in safetensors (the format of the coordinator's
checkpoints: raw tensors and a JSON header), each file replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from models import ModelFamily, SubmodelSpec
from protocol import ModelRef

__all__ = ["CopyStore", "read_copies", "write_copies"]

Weights = dict[str, np.ndarray]


def write_copies(path: Path, copies: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Write ``copies`` (state dicts as arrays) to ``path`` atomically, as ``<copy>.<tensor>`` entries."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({f"{index}.{key}": np.ascontiguousarray(array) for index, copy in enumerate(copies)
               for key, array in copy.items()}, str(tmp))
    os.replace(tmp, path)


def read_copies(path: Path, count: int, keys: Sequence[str]) -> list[Weights]:
    """The ``count`` copies stored at ``path``, each with exactly ``keys``; ValueError when they are not there."""
    try:
        stored = load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ValueError(f"cannot read the stored copies at {path}: {exc}") from None
    copies = []
    for index in range(count):
        copy = {key: stored.get(f"{index}.{key}") for key in keys}
        missing = [key for key, array in copy.items() if array is None]
        if missing:
            raise ValueError(f"the stored copies at {path} lack copy {index}'s {missing[:3]}")
        copies.append({key: array for key, array in copy.items() if array is not None})
    return copies


class CopyStore:
    """The auxiliary copies of every (model, spec) this device trained with mutual distillation."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, model: ModelRef, spec: SubmodelSpec) -> Path:
        """Where the copies of ``model`` at ``spec`` live (named by a digest: the names are wire data)."""
        key = json.dumps({"model": [model.family, model.num_classes, model.in_channels, model.options],
                          "spec": spec.to_dict()}, sort_keys=True, default=str)
        return self.directory / f"copies-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"

    def load(self, model: ModelRef, family: ModelFamily, spec: SubmodelSpec, count: int, seed: int) -> list[Weights]:
        """``count`` auxiliary copies: the stored ones first (a stored file that cannot be read, or has fewer, is
        topped up), new ones initialised at random from ``seed``."""
        keys = family.state_keys(spec)
        path = self.path(model, spec)
        copies: list[Weights] = []
        for have in range(count, 0, -1):
            try:
                copies = read_copies(path, have, keys)
                break
            except ValueError:
                continue
        for index in range(len(copies), count):
            with torch.random.fork_rng(devices=[]):  # the agent's own random state is left alone
                torch.manual_seed(seed * 1_000_003 + index)
                state = family.build(spec, track_bn_stats=False).state_dict()
            copies.append({key: state[key].detach().numpy().astype(np.float32) for key in keys})
        return copies

    def save(self, model: ModelRef, spec: SubmodelSpec, copies: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Keep ``copies`` for the next task of ``model`` at ``spec`` (replacing what was stored)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_copies(self.path(model, spec), copies)
