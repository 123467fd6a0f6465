"""Coordinator logic that needs no broker: resume from a checkpoint, and validation of incoming updates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.data import load_dataset
from coordinator.checkpoint import save_checkpoint
from coordinator.config import CoordinatorConfig, DataConfig, ModelConfig, RecipeConfig
from coordinator.daemon import Coordinator
from coordinator.strategies import Assignment
from models import SubmodelSpec
from protocol import Update


def config(tmp_path: Path, **overrides: object) -> CoordinatorConfig:
    cfg = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}),
                            data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50),
                            recipe=RecipeConfig(batch_size=8), levels=[1.0, 0.5], state_dir=str(tmp_path))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def update_for(coordinator: Coordinator, spec: SubmodelSpec, *, labels: list[int], fill: float = 1.0,
               drop: str | None = None) -> Update:
    keys = coordinator.family.trainable_keys(spec)
    state = coordinator.family.extract(coordinator.states["global"], spec, keys=keys)
    weights = {k: np.full(tuple(v.shape), fill, dtype=np.float32) for k, v in state.items() if k != drop}
    return Update("t-1", 1, "dev", "ok", spec.to_dict(), 10, labels, weights, {}, None)


def test_resume_continues_from_the_checkpoint(tmp_path: Path, digits) -> None:
    first = Coordinator(config(tmp_path), dataset=digits)
    marked = {k: v.clone() for k, v in first.states["global"].items()}
    marked["classifier.bias"] = torch.full_like(marked["classifier.bias"], 7.0)
    save_checkpoint(first.checkpoint_path, {"global": marked},
                    {"round": 3, "algorithm": "heterofl", "family": "cnn"})
    resumed = Coordinator(config(tmp_path, resume=True), dataset=digits)
    assert resumed.completed_rounds == 3
    torch.testing.assert_close(resumed.states["global"]["classifier.bias"], marked["classifier.bias"])
    fresh = Coordinator(config(tmp_path, resume=False), dataset=digits)
    assert fresh.completed_rounds == 0


def test_resume_refuses_a_checkpoint_of_another_algorithm(tmp_path: Path, digits) -> None:
    first = Coordinator(config(tmp_path), dataset=digits)
    save_checkpoint(first.checkpoint_path, first.states, {"round": 1, "algorithm": "fedavg", "family": "cnn"})
    with pytest.raises(ValueError, match="fedavg"):
        Coordinator(config(tmp_path, resume=True), dataset=digits)


def test_update_validation(tmp_path: Path, digits) -> None:
    coordinator = Coordinator(config(tmp_path), dataset=digits)
    half, full = SubmodelSpec.uniform(0.5), SubmodelSpec.full()
    assignment = Assignment("dev", "b", half, "global")
    spec, state, _ = coordinator._unpack_update(update_for(coordinator, half, labels=[0, 1]), assignment)
    assert spec == half and set(state) == set(coordinator.family.trainable_keys(half))
    with pytest.raises(ValueError, match="larger"):
        coordinator._unpack_update(update_for(coordinator, full, labels=[0]), assignment)
    with pytest.raises(ValueError, match="missing"):
        coordinator._unpack_update(update_for(coordinator, half, labels=[0], drop="conv1.bias"), assignment)


def test_masked_cross_entropy_keeps_absent_class_rows(tmp_path: Path, digits) -> None:
    cfg = config(tmp_path)
    cfg.recipe.masked_ce = True
    coordinator = Coordinator(cfg, dataset=digits)
    assignment = Assignment("dev", "a", SubmodelSpec.full(), "global")
    _, state, index_map = coordinator._unpack_update(
        update_for(coordinator, SubmodelSpec.full(), labels=[2, 5]), assignment)
    assert state["classifier.weight"].shape[0] == 2
    assert index_map["classifier.weight"][0].tolist() == [2, 5]
