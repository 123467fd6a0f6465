"""What the ServerApp and the ClientApp share: the workload file and FedFit's own rules for a task's seed.

The workload file (JSON, written by ``benchmarks/flower_race.py``) holds ``coordinator``: the coordinator
configuration FedFit's side runs (as a mapping, read with :func:`common.config.from_mapping`), so that both sides
take the model, the recipe, the seed and the evaluation data from one place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from common.config import from_mapping
from coordinator.config import CoordinatorConfig


def load_workload(path: str) -> dict[str, Any]:
    """The workload file ``flower_race.py`` wrote."""
    if not path:
        raise ValueError("run config 'workload-file' is empty: this app is started by benchmarks/flower_race.py")
    return dict(json.loads(Path(path).read_text()))


def coordinator_config(workload: dict[str, Any]) -> CoordinatorConfig:
    """The coordinator configuration of the workload, validated as FedFit's coordinator validates it."""
    config = from_mapping(CoordinatorConfig, workload["coordinator"])
    config.validate()
    return config


def task_seed(seed: int, round_number: int, agent_id: str) -> int:
    """The seed FedFit's coordinator gives a task (``Coordinator._seeded``): the same batches in the same order."""
    material = f"{seed}:{round_number}:{agent_id}".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:4], "little")


def process_start_time() -> float:
    """When this process started (Unix time), from ``/proc``: a Flower ClientApp process is started per message."""
    with open("/proc/self/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    started_ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
    with open("/proc/stat") as handle:
        boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    return boot + started_ticks / os.sysconf("SC_CLK_TCK")
