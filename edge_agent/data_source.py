"""Builds the agent's :class:`LocalData` from its configuration: a file or folder on the device, or a
shard of a known dataset (simulations and demos). A shard is read with :func:`common.data.load_shard`: the same
samples the simulator and the coordinator's partition give that client, without scikit-learn, scipy or a whole
float32 training set in the agent process."""

from __future__ import annotations

import numpy as np

from common.data import load_local_data, load_shard, parse_partition
from edge_agent.config import AgentDataConfig
from edge_agent.runner import LocalData


def to_local_data(x: np.ndarray, y: np.ndarray) -> LocalData:
    """The agent's data from numpy arrays (float32 samples, int64 labels; copied where the types differ)."""
    return LocalData(np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64))


def load_agent_data(config: AgentDataConfig) -> LocalData:
    """The agent's private data; raises DatasetError / ValueError with a clear sentence."""
    if config.path is not None:
        normalize = None
        if config.normalize is not None:
            if len(config.normalize) != 2 or config.normalize[1] <= 0:
                raise ValueError("data.normalize must be [mean, std] with std > 0")
            normalize = (float(config.normalize[0]), float(config.normalize[1]))
        x, y = load_local_data(config.path, normalize=normalize)
        return to_local_data(x, y)
    assert config.dataset is not None
    x, y = load_shard(config.dataset, config.root, config.num_shards, parse_partition(config.partition),
                      config.shard, config.seed)
    return to_local_data(x, y)
