"""Tests for edge_agent.data_source: an agent's shard of a known dataset is the simulator's shard, and loading it
brings neither scikit-learn, scipy nor torch into the agent process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from common.data import load_dataset, parse_partition, partition_indices
from edge_agent.config import AgentDataConfig
from edge_agent.data_source import load_agent_data

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.parametrize(("partition", "num_shards", "shard", "seed"),
                         [("iid", 4, 1, 0), ("dirichlet:0.5", 5, 3, 2), ("shards:2", 10, 7, 1)])
def test_a_digits_shard_is_the_simulators_shard(partition: str, num_shards: int, shard: int, seed: int) -> None:
    data = load_agent_data(AgentDataConfig(dataset="digits", partition=partition, num_shards=num_shards,
                                           shard=shard, seed=seed))
    d = load_dataset("digits")
    indices = partition_indices(d.y_train, num_shards, parse_partition(partition), seed)[shard]
    assert data.x.tobytes() == d.x_train[indices].tobytes() and data.x.shape == d.x_train[indices].shape
    np.testing.assert_array_equal(data.y, d.y_train[indices])
    assert data.labels == sorted({int(v) for v in d.y_train[indices]})


def test_a_file_still_loads(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((6, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=np.arange(6) % 3)
    data = load_agent_data(AgentDataConfig(path=str(tmp_path / "data.npz")))
    np.testing.assert_array_equal(data.x, x)
    assert data.labels == [0, 1, 2]


def test_loading_shards_keeps_sklearn_scipy_and_torch_out_of_the_process() -> None:
    configs = [{"dataset": "digits", "partition": "shards:2", "num_shards": 10, "shard": 4}]
    if SYSTEM_FASHION.is_dir():
        configs.append({"dataset": "fashion-mnist", "partition": "iid", "num_shards": 10, "shard": 0})
    code = textwrap.dedent(f"""
        import json, sys
        from edge_agent.config import AgentDataConfig
        from edge_agent.data_source import load_agent_data
        sizes = [len(load_agent_data(AgentDataConfig(**c)).y) for c in {configs!r}]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("sklearn", "scipy", "torch"))
        print(json.dumps({{"sizes": sizes, "heavy": heavy}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert len(result["sizes"]) == len(configs) and all(size > 0 for size in result["sizes"])
