"""Hostile traffic on every topic the coordinator and the agents subscribe to, from stolen logins (the
coordinator's and each device's; the broker's ACL drops what a login may not publish): each bad payload that gets
through is rejected with a logged reason, neither process crashes, and the federation completes."""

from __future__ import annotations

import random
import threading
import time

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
import structlog
import torch
from paho.mqtt.enums import CallbackAPIVersion

from common.data import load_dataset
from coordinator.daemon import Coordinator
from protocol import (
    Ack,
    AgentStatus,
    ModelRef,
    Recipe,
    Task,
    Topics,
    Update,
    encode,
    split_payload,
)

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

AGENTS = ("dev-a", "dev-b")


def hostile_payloads(rng: random.Random) -> list[bytes]:
    """Garbage of every kind: random bytes, truncations, wrong types, lies about sizes, NaN weights."""
    zeros = {"w": np.zeros((2, 2), dtype=np.float32)}
    clean = msgpack.unpackb(encode(Update("r1-dev-a-0000", 1, "dev-a", "ok", {"width": 1.0}, 5, [0, 1], zeros,
                                          {}, None), version=1))  # the map of version 1: tensors inline
    clean["weights"]["w"]["data"] = np.full((2, 2), np.nan, dtype="<f4").tobytes()
    nan_update = msgpack.packb(clean)  # the encoder refuses NaN, so forge it
    task = Task("r9-dev-a-0000", 9, "dev-a", time.time() + 60, ModelRef("cnn", 10, 1, {}), {"width": 1.0},
                Recipe(1, 8, 0.1, 0.0, 0.0, None, False, 0), {"w": np.zeros(3, dtype=np.float32)})
    valid = encode(task)
    lying_tensor = msgpack.packb({"v": 1, "type": "update", "task_id": "x", "round": 1, "agent_id": "dev-a",
                                  "status": "ok", "spec_trained": None, "num_samples": 1, "labels": [0],
                                  "weights": {"w": {"dtype": "float32", "shape": [1 << 20, 1 << 20],
                                                    "data": b"\0" * 16}},
                                  "metrics": {}, "reason": None})
    payloads = [
        b"",
        b"\x00" * 17,
        bytes(rng.getrandbits(8) for _ in range(300)),
        valid[: len(valid) // 2],
        msgpack.packb({"v": 1, "type": "task", "task_id": 5}),
        msgpack.packb({"v": 99, "type": "ack", "task_id": "a", "round": 1, "agent_id": "dev-a"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1, "type": "chunk", "transfer": "t1", "seq": 0, "count": 1, "total": 3,
                       "sha256": "0" * 64, "data": b"abc"}),  # checksum mismatch
        msgpack.packb({"v": 1, "type": "chunk", "transfer": "t2", "seq": 5, "count": 2, "total": 2 ** 40,
                       "sha256": "0" * 64, "data": b""}),  # absurd total, seq out of range
        lying_tensor,
        *split_payload(lying_tensor, "lie-1"),
        *split_payload(nan_update, "nan-1"),
        *split_payload(b"\xc1" * 50, "bad-inner-1"),  # a well-formed chunk around garbage
        encode(AgentStatus("someone-else", "online", None, time.time())),  # status under another id
        encode(Ack("r1-unknown", 1, "dev-a")),  # an ack of nothing
    ]
    return payloads


def test_garbage_everywhere_is_rejected_and_federation_completes(secured_mosquitto: SecuredBroker, tmp_path) -> None:
    dataset = load_dataset("digits")
    topics = Topics("hostile")
    broker = secured_mosquitto("hostile")
    config = on_broker(tiny_config(federation="hostile", rounds=2, min_agents=len(AGENTS), state_dir=str(tmp_path)),
                       broker)
    targets = [topics.coordinator_status(), topics.agent_status("ghost")]
    for agent_id in AGENTS:
        targets += [topics.agent_task(agent_id), topics.agent_ack(agent_id), topics.agent_update(agent_id),
                    topics.agent_status(agent_id)]

    with structlog.testing.capture_logs() as logs:
        coordinator = Coordinator(config, dataset=dataset)
        agents = digits_fleet(dataset, AGENTS, config, broker)
        attackers = []
        for index, login in enumerate([broker.coordinator_config(), *(broker.client_config(a) for a in AGENTS)]):
            attacker = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"attacker-{index}")
            attacker.username_pw_set(*login.login())
            attacker.tls_set(ca_certs=login.ca_file)
            attacker.connect(broker.host, broker.port)
            attacker.loop_start()
            attackers.append(attacker)
        stop = threading.Event()

        def attack() -> None:
            rng = random.Random(7)
            while not stop.is_set():
                for payload in hostile_payloads(rng):
                    for topic in targets:
                        for attacker in attackers:
                            attacker.publish(topic, payload, qos=1)
                stop.wait(0.3)

        try:
            coordinator.start()
            for agent in agents:
                agent.start()
            attacker_thread = threading.Thread(target=attack, daemon=True)
            attacker_thread.start()
            results = coordinator.run()
        finally:
            stop.set()
            for attacker in attackers:
                attacker.loop_stop()
                attacker.disconnect()
            for agent in agents:
                agent.stop()
            coordinator.stop()

    assert [r.round for r in results] == [1, 2]
    assert all(r.participants == len(AGENTS) for r in results), [r.tasks for r in results]
    assert coordinator.rejected_messages > 0
    assert all(agent.rejected_messages > 0 for agent in agents)
    assert all(agent.tasks_done == 2 for agent in agents)
    rejections = [entry for entry in logs if entry["event"] == "message_rejected"]
    assert rejections and all(entry.get("reason") for entry in rejections)
    reasons = " ".join(entry["reason"] for entry in rejections).lower()
    for fragment in ("nan", "sha256", "version"):
        assert fragment in reasons, fragment
    assert not [entry for entry in logs if entry["event"] in ("message_handler_failed", "task_crashed")]
    assert torch.isfinite(torch.cat([t.flatten().float() for t in coordinator.states["global"].values()])).all()
