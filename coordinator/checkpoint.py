"""Atomic checkpoints in safetensors (nothing is pickled): model states per group plus metadata."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.durable import sync_directory
from coordinator.config import CoordinatorConfig
from coordinator.planning import model_options
from coordinator.strategies.base import Strategy
from coordinator.tasks import State

FORMAT = "fedfit-checkpoint-v1"


class CheckpointError(RuntimeError):
    """A checkpoint could not be read; the message names the file and the problem."""


def save_checkpoint(path: str | Path, states: Mapping[str, Mapping[str, torch.Tensor]],
                    metadata: Mapping[str, Any]) -> None:
    """Write all group states to ``path`` atomically (temp file, fsync, rename, fsync directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"{group}/{key}": value.detach().contiguous().cpu()
               for group, state in states.items() for key, value in state.items()}
    meta = {"format": FORMAT, "groups": json.dumps(sorted(states)), "meta": json.dumps(dict(metadata))}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    sync_directory(path.parent)


def load_checkpoint(path: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`: (states per group, metadata)."""
    path = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            raw_meta = handle.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if raw_meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a FedFit checkpoint (format {raw_meta.get('format')!r})")
    try:
        groups = json.loads(raw_meta["groups"])
        metadata = json.loads(raw_meta["meta"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} has damaged metadata: {exc}") from exc
    states: dict[str, dict[str, torch.Tensor]] = {group: {} for group in groups}
    for name, tensor in tensors.items():
        group, _, key = name.partition("/")
        if group not in states:
            raise CheckpointError(f"checkpoint {path} has a tensor {name!r} of an undeclared group")
        states[group][key] = tensor
    return states, metadata


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path`` (its tensors are not read); CheckpointError when it cannot be
    read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
        metadata = json.loads(raw["meta"])
    except (OSError, SafetensorError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the metadata of checkpoint {path}: {exc}") from exc
    return dict(metadata)


def starting_states(path: Path, config: CoordinatorConfig, strategy: Strategy) -> tuple[dict[str, State], int]:
    """The states a run starts from and the rounds already done: the checkpoint's with ``resume`` (see
    :func:`restore_checkpoint`), else the strategy's initial ones; ValueError when ``path`` holds an earlier run
    that ``resume`` does not ask to continue."""
    if config.resume and path.exists():
        return restore_checkpoint(path, config, strategy)
    if path.exists():
        raise ValueError(f"state_dir {path.parent} holds an earlier run (checkpoint.safetensors): set resume: "
                         f"true to continue it, or give this run another state_dir")
    return strategy.initial_states(config.seed), 0


def restore_checkpoint(path: Path, config: CoordinatorConfig, strategy: Strategy) -> tuple[dict[str, State], int]:
    """The states and the completed round of the run ``path`` holds, for ``strategy`` to go on from: its own
    state first (what its set-up computed, e.g. FlexFL's pool, is restored, not redone), then its model groups,
    which must be the strategy's and hold its tensors (ValueError otherwise, naming the file)."""
    states, meta = load_checkpoint(path)
    if meta.get("algorithm") != config.algorithm or meta.get("family") != config.model.family:
        raise ValueError(f"checkpoint {path} is for {meta.get('algorithm')}/{meta.get('family')}, not "
                         f"{config.algorithm}/{config.model.family}; use another state_dir or set resume: false")
    strategy.load_state_dict(meta.get("strategy", {}))
    fresh = strategy.initial_states(config.seed)
    if set(states) != set(fresh):
        raise ValueError(f"checkpoint {path} holds model groups {sorted(states)}, this {config.algorithm} run "
                         f"keeps {sorted(fresh)}; use another state_dir")
    for group, state in states.items():
        if set(state) != set(fresh[group]):
            made_with = meta.get("model_options")
            raise ValueError(f"checkpoint {path} does not match this model (group {group})" + (
                f": it was made with model options {made_with}, this run has {model_options(config)}"
                if made_with is not None and made_with != model_options(config) else
                "; was it made before DepthFL's heads lost their convolutions? set model.options.exit_convs: 3 to "
                "resume it" if made_with is None and config.algorithm == "depthfl" else ""))
    return states, int(meta.get("round", 0))
