"""Sample messages and a comparison helper shared by the protocol tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import (
    Ack,
    Adaptation,
    AgentStatus,
    Candidate,
    Capabilities,
    CoordinatorStatus,
    LossTerm,
    Message,
    ModelRef,
    OptimizerSettings,
    Recipe,
    Stage,
    Task,
    TrainingPlan,
    Update,
    encode,
)


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(5).astype(np.float16),
        "bn.num_batches_tracked": np.array(12, dtype=np.int64),
        "mask": rng.random((2, 3)) > 0.5,
        "empty": np.zeros((0, 7), dtype=np.float64),
    }


SAMPLE_PLAN = TrainingPlan(
    optimizer=OptimizerSettings(kind="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4, clip_norm=5.0),
    epochs=2,
    batch_size=32,
    seed=42,
    loss=(
        LossTerm.ce(masked=True),
        LossTerm.ce(weight=0.5, output=-2),
        LossTerm.kd(-2, -1, weight=0.3, tau=3.0, detach_teacher=True),
    ),
    schedule=(Stage(epochs=2, route="skip"), Stage(epochs=1, route="exit")),
)
"""A plan with every feature: masked and plain CE terms, a distillation term and a two-stage schedule."""

CANDIDATE_PLAN = TrainingPlan(
    optimizer=OptimizerSettings(lr=0.1, clip_norm=None), epochs=1, batch_size=16, seed=42,
    loss=(LossTerm.ce(), LossTerm.kd(0, -1, weight=1.0, tau=2.0)),
)
SEGMENT_PLAN = TrainingPlan(seed=42, schedule=(Stage(3, "exit"), Stage(1, "skip")))


def make_messages() -> dict[str, Message]:
    """One valid message of every kind (two statuses: with and without capabilities; two tasks: one with a
    training plan and a ladder, one with a recipe and the legacy width-levels hint)."""
    rng = np.random.default_rng(7)
    capabilities = Capabilities(
        device_kind="raspberry-pi-5",
        memory_total=8 * 2**30,
        memory_available=3 * 2**30,
        budget_bytes=2**30,
        num_samples=1200,
        labels=[0, 1, 4, 9],
    )
    return {
        "status": AgentStatus(
            agent_id="pi-01", state="online", capabilities=capabilities, sent_at=1700000000.5
        ),
        "status_offline": AgentStatus(agent_id="pi-01", state="offline", capabilities=None, sent_at=0.0),
        "coordinator_status": CoordinatorStatus(
            federation="lab", state="online", round=3, sent_at=1700000001.0
        ),
        "task": Task(
            task_id="r3:pi-01",
            round=3,
            agent_id="pi-01",
            deadline=1700000600.0,
            model=ModelRef(
                family="resnet", num_classes=10, in_channels=3, options={"depth": 18, "w": [1.0, 0.5]}
            ),
            spec={"width": 0.5, "blocks": [{"keep": [0, 2, 3], "exit": None}], "name": "level-2", "kd": True},
            recipe=None,
            weights=_weights(rng),
            adaptation=Adaptation(
                kind="ladder",
                candidates=[
                    Candidate(spec={"width": 0.25, "name": "level-3"}, plan=CANDIDATE_PLAN),
                    Candidate(spec={"width": 0.125, "segments": [[0, 1], [2]]}, plan=SEGMENT_PLAN),
                ],
            ),
            plan=SAMPLE_PLAN,
        ),
        "task_recipe": Task(
            task_id="r3:pi-02",
            round=3,
            agent_id="pi-02",
            deadline=1700000600.0,
            model=ModelRef(family="cnn", num_classes=10, in_channels=1, options={}),
            spec={"width": 0.5},
            recipe=Recipe(
                epochs=2,
                batch_size=32,
                lr=0.05,
                momentum=0.9,
                weight_decay=5e-4,
                clip_norm=5.0,
                masked_ce=True,
                seed=42,
            ),
            weights=_weights(rng),
            adaptation=Adaptation(kind="width-levels", rates=[1.0, 0.5, 0.25]),
        ),
        "update": Update(
            task_id="r3:pi-01",
            round=3,
            agent_id="pi-01",
            status="adapted",
            spec_trained={"width": 0.25},
            num_samples=1200,
            labels=[0, 1, 4, 9],
            weights=_weights(rng),
            metrics={"loss": 0.71, "accuracy": 0.8, "peak_bytes": 123456789.0},
            reason="memory: trained a narrower level",
        ),
        "ack": Ack(task_id="r3:pi-01", round=3, agent_id="pi-01"),
    }


def make_old_task() -> tuple[dict[str, Any], Task]:
    """A task as a coordinator that predates training plans sends it, and the Task it decodes to.

    The map is built by hand (not by `encode`): it has a ``recipe`` and neither a ``plan`` nor an
    ``adaptation`` key, and its tensors are written as raw little-endian bytes.
    """
    conv = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    counts = np.array([3, 1, 4], dtype=np.int64)
    wire: dict[str, Any] = {
        "v": 1,
        "type": "task",
        "task_id": "r1:old-pi",
        "round": 1,
        "agent_id": "old-pi",
        "deadline": 1600000000.0,
        "model": {"family": "cnn", "num_classes": 10, "in_channels": 1, "options": {"hidden": 64}},
        "spec": {"width": 0.25},
        "recipe": {
            "epochs": 3, "batch_size": 20, "lr": 0.01, "momentum": 0.5, "weight_decay": 1e-4,
            "clip_norm": None, "masked_ce": True, "seed": 9,
        },
        "weights": {
            "conv.weight": {"dtype": "float32", "shape": [2, 3, 4], "data": conv.astype("<f4").tobytes()},
            "counts": {"dtype": "int64", "shape": [3], "data": counts.astype("<i8").tobytes()},
        },
    }  # fmt: skip
    task = Task(
        task_id="r1:old-pi",
        round=1,
        agent_id="old-pi",
        deadline=1600000000.0,
        model=ModelRef(family="cnn", num_classes=10, in_channels=1, options={"hidden": 64}),
        spec={"width": 0.25},
        recipe=Recipe(
            epochs=3, batch_size=20, lr=0.01, momentum=0.5, weight_decay=1e-4, clip_norm=None, masked_ce=True,
            seed=9,
        ),
        weights={"conv.weight": conv, "counts": counts},
    )
    return wire, task


@pytest.fixture
def old_task_wire() -> dict[str, Any]:
    """A fresh copy of the hand-built wire map of an old coordinator's task (see `make_old_task`)."""
    return make_old_task()[0]


@pytest.fixture
def messages() -> dict[str, Message]:
    """Fresh sample messages for each test."""
    return make_messages()


def assert_same_message(actual: object, expected: Message) -> None:
    """Field-by-field equality; weights compared with numpy.testing (values, dtype and shape)."""
    assert type(actual) is type(expected)
    for field in fields(expected):
        got, want = getattr(actual, field.name), getattr(expected, field.name)
        if field.name == "weights":
            assert sorted(got) == sorted(want)
            for name, array in want.items():
                assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
                np.testing.assert_array_equal(got[name], array, err_msg=name)
        else:
            assert got == want, field.name


@pytest.fixture
def assert_same() -> Callable[[object, Message], None]:
    """The `assert_same_message` helper, as a fixture so test modules need no imports from here."""
    return assert_same_message


def wire_of(message: Message) -> dict[str, Any]:
    """The msgpack map a message encodes to in protocol version 1 (tensors as maps inside it); the header of a
    version 2 payload is the same map but for the tensors (see `head_of`)."""
    unpacked: dict[str, Any] = msgpack.unpackb(encode(message, version=1), raw=False)
    return unpacked


def head_of(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """The message map of a version 2 payload and its tensor section (the bin after it, padding included)."""
    outer = msgpack.unpackb(payload, raw=False)
    assert list(outer) == ["v", "h", "m", "d"] and outer["v"] == 2
    return outer["m"], outer["d"]


def framed(head: dict[str, Any], data: bytes, pad: int | None = None) -> bytes:
    """A version 2 payload of a (hand-made) message map and tensor data, laid out as `protocol.framing` says:
    ``pad`` zero bytes (default: those that align the data on 64 bytes) before ``data``."""
    packed = pack(head)
    data_at = 13 + len(packed) + 7
    pad = -data_at % 64 if pad is None else pad
    return b"".join((b"\x84\xa1v\x02\xa1h\xce", len(packed).to_bytes(4, "big"), b"\xa1m", packed, b"\xa1d\xc6",
                     (pad + len(data)).to_bytes(4, "big"), bytes(pad), data))


def pack(obj: object) -> bytes:
    """Raw msgpack bytes, for hand-made (often malformed) payloads."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed
