"""Safetensors checkpoints: round trip, no pickle, damaged files, atomic writes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from coordinator.checkpoint import FORMAT, CheckpointError, load_checkpoint, save_checkpoint


def two_groups() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "a": {"conv1.weight": torch.randn(4, 1, 3, 3), "bn1.num_batches_tracked": torch.tensor(3)},
        "b": {"conv1.weight": torch.randn(2, 1, 3, 3), "classifier.bias": torch.zeros(10)},
    }


def test_round_trip_two_groups_and_metadata(tmp_path):
    states = two_groups()
    meta = {"round": 3, "algorithm": "decoupled", "family": "cnn", "nested": {"x": [1, 2]}}
    path = tmp_path / "sub" / "checkpoint.safetensors"
    save_checkpoint(path, states, meta)
    loaded, loaded_meta = load_checkpoint(path)
    assert loaded_meta == meta
    assert set(loaded) == {"a", "b"}
    for group, state in states.items():
        assert set(loaded[group]) == set(state)
        for key, tensor in state.items():
            assert loaded[group][key].dtype == tensor.dtype
            torch.testing.assert_close(loaded[group][key], tensor)


def test_group_without_tensors_survives_round_trip(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": {"w": torch.ones(2)}, "empty": {}}, {})
    loaded, _ = load_checkpoint(path)
    assert loaded["empty"] == {} and set(loaded) == {"a", "empty"}


def test_file_is_safetensors_not_pickle(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, two_groups(), {"round": 1})
    data = path.read_bytes()
    assert not data.startswith(b"\x80")  # pickle protocol >= 2
    assert not data.startswith(b"PK\x03\x04")  # torch.save zip archive
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    assert header["__metadata__"]["format"] == FORMAT
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {"a/conv1.weight", "a/bn1.num_batches_tracked", "b/conv1.weight",
                                      "b/classifier.bias"}
        assert handle.metadata()["format"] == FORMAT
        assert json.loads(handle.metadata()["groups"]) == ["a", "b"]


def test_overwrite_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, {"g": {"w": torch.zeros(3)}}, {"round": 1})
    save_checkpoint(path, {"g": {"w": torch.ones(3)}}, {"round": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]
    states, meta = load_checkpoint(path)
    assert meta == {"round": 2}
    torch.testing.assert_close(states["g"]["w"], torch.ones(3))


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x80\x04\x95 pickled", b"PK\x03\x04zip archive"])
def test_damaged_file_raises_checkpoint_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        load_checkpoint(path)


def test_truncated_checkpoint_raises_checkpoint_error(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, two_groups(), {"round": 1})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_missing_file_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_foreign_safetensors_file_is_rejected(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.ones(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a FedFit checkpoint"):
        load_checkpoint(path)


def test_damaged_metadata_is_rejected(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"a/w": torch.ones(2)}, str(path), metadata={"format": FORMAT, "groups": "[not json", "meta": "{}"})
    with pytest.raises(CheckpointError, match="damaged metadata"):
        load_checkpoint(path)


def test_tensor_of_undeclared_group_is_rejected(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"a/w": torch.ones(2), "zzz/w": torch.ones(2)}, str(path),
              metadata={"format": FORMAT, "groups": json.dumps(["a"]), "meta": "{}"})
    with pytest.raises(CheckpointError, match="undeclared group"):
        load_checkpoint(path)
