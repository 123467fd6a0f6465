"""What a secure round costs over MQTT: the coordinator's secure-aggregation room (`coordinator.secure.room`) and the
devices' own part (`edge_agent.secure_round.SecureTasks`) exchanging their real messages through a real mosquitto on
loopback, against a plain round's uploads of the same updates, at 8 and 100 devices, with none and 10% of them gone
after they shared their keys.

Run as ``.venv/bin/python benchmarks/secure_rounds_mqtt.py [--devices 8,100] [--dropout 0,0.1] [--repeat 2]`` (a
benchmark: it prints, never fails on a number; each figure is the least of ``--repeat`` rounds). The model is
PreResNet-20 for 28x28 images (272,474 parameters), HeteroFL's width slices (a third of the devices each at widths
1, 1/2 and 1/4), each device's update its slice moved at random. Training is not run: a round starts with every update
trained. Per round it prints:

- **seconds**: from the first advert (secure) or the first upload (plain) to the round's new model, wall clock, and
  the secure round's phases (adverts -> rosters, shares -> relays, the masked uploads, the shares given back and the
  unmasking);
- **bytes per device**: the secure exchange's own messages (adverts, rosters, sealed shares, relays, requests,
  reveals) and the masked update (8 bytes a value) against the plain update (float32), as published (msgpack and
  the chunks' framing included), the mean over the devices.

Every device runs in this one process, on one MQTT connection, on this machine's cores: the devices' work, which a
fleet does in parallel, is done here one after the other, so the secure phases' seconds are an upper bound of what
the coordinator waits for a fleet of devices of this machine's speed.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from common.logs import get_logger
from common.mqtt_link import BrokerConfig, MqttLink
from coordinator.aggregation import RoundAggregate
from coordinator.config import CoordinatorConfig
from coordinator.secure.room import SecureRounds
from coordinator.secure.settings import SecureAggregationConfig
from coordinator.tasks import TaskPlan, TaskResult
from edge_agent.secure_round import FROM_COORDINATOR, SecureTasks
from fedfit.sim.broker import start_broker
from models import SubmodelSpec
from models.registry import get_family
from protocol import (
    Ack,
    ModelRef,
    Reassembler,
    SecureRoster,
    Task,
    Topics,
    TrainingPlan,
    Update,
    UpdateStatus,
    decode,
    encode,
    message_type,
    parse_agent_topic,
    split_payload,
)

FEDERATION = "bench-secure"
WIDTHS = (1.0, 0.5, 0.25)
LOG = get_logger("bench")


class Fleet:
    """Devices and the coordinator's room on one broker; ``dropped``: devices gone after they shared."""

    def __init__(self, broker: BrokerConfig, devices: int, seed: int) -> None:
        self.family = get_family("preresnet20", 10, 1)
        torch.manual_seed(seed)
        self.states = {"global": self.family.build().state_dict()}
        self.topics = Topics(FEDERATION)
        self.names = [f"d{index:03d}" for index in range(devices)]
        self.bytes: dict[str, int] = defaultdict(int)
        self.reassembler = Reassembler()
        self.arrived: list[Update] = []
        self.changed = threading.Condition()
        self.dropped: set[str] = set()
        self.coordinator = MqttLink(client_id="bench-coordinator", broker=broker,
                                    subscriptions=[self.topics.all_agent_updates()], handler=self.on_update)
        self.devices = MqttLink(client_id="bench-devices", broker=broker,
                                subscriptions=[f"fedfit/v1/{FEDERATION}/agents/+/ack"], handler=self.on_ack)
        config = CoordinatorConfig(federation=FEDERATION,
                                   secure_aggregation=SecureAggregationConfig(enabled=True, phase_s=120.0))
        self.room = SecureRounds(config, self.coordinator, self.topics, self.family, 10, LOG)
        self.rooms = {name: SecureTasks(name, FEDERATION, self.publisher(name), self.sender(name), LOG)
                      for name in self.names}
        rng = np.random.default_rng(seed)
        self.specs = {name: SubmodelSpec(width=WIDTHS[index % 3]) for index, name in enumerate(self.names)}
        self.updates = {}
        for name, spec in self.specs.items():
            sent = self.family.extract(self.states["global"], spec, keys=self.family.trainable_keys(spec))
            self.updates[name] = {key: (value.numpy() + rng.normal(0, 0.01, value.shape)).astype(np.float32)
                                  for key, value in sent.items()}

    def publisher(self, name: str) -> Callable[[object], None]:
        def publish(message: object) -> None:
            payload = encode(message)  # type: ignore[arg-type]
            self.bytes[name] += len(payload)
            self.devices.publish(self.topics.agent_update(name), payload)
        return publish

    def sender(self, name: str) -> Callable[..., None]:
        def send(update: Update, *, version: int = 2, ask: bool = False) -> None:
            for chunk in split_payload(encode(update, version=version), update.task_id):
                self.bytes[name] += len(chunk)
                self.devices.publish(self.topics.agent_update(name), chunk)
        return send

    def on_update(self, topic: str, payload: bytes) -> None:
        _, agent, _ = parse_agent_topic(topic)
        if (message_type(payload) or "").startswith("secure_"):
            self.room.on_message(agent, payload)
            return
        whole = self.reassembler.feed_transfer(payload, source=agent)
        if whole is not None:
            update = decode(whole.payload, expected=Update)
            assert isinstance(update, Update)
            with self.changed:
                self.arrived.append(update)
                self.changed.notify_all()

    def on_ack(self, topic: str, payload: bytes) -> None:
        _, agent, _ = parse_agent_topic(topic)
        self.bytes[agent] += len(payload)
        message = decode(payload, expected=(Ack, *FROM_COORDINATOR))
        if agent in self.dropped and not isinstance(message, SecureRoster):
            return  # gone once it shared: it neither masks nor gives shares back
        self.rooms[agent].take(message)

    def wait_for(self, count: int) -> None:
        with self.changed:
            while len(self.arrived) < count:
                self.changed.wait(1.0)

    def tasks(self, round_number: int, secure: bool = True) -> dict[str, TaskPlan]:
        return {f"r{round_number}-{name}": TaskPlan(name, "a", spec, TrainingPlan(), secure=secure)
                for name, spec in self.specs.items()}

    def update_of(self, task_id: str, name: str, round_number: int) -> Update:
        return Update(task_id, round_number, name, UpdateStatus.OK, None, 100, list(range(10)),
                      dict(self.updates[name]), {})

    def secure_round(self, round_number: int, dropout: float, seed: int) -> dict[str, float]:
        tasks = self.tasks(round_number)
        self.bytes.clear()
        self.arrived = []
        rng = np.random.default_rng(seed)
        narrow = [name for index, name in enumerate(self.names) if index % 3 == 2]
        self.dropped = set(rng.choice(narrow, size=round(dropout * len(self.names)), replace=False).tolist())
        base = RoundAggregate(self.states, lambda _result: 1.0, list(self.family.classifier_keys()))
        aggregate = self.room.aggregate(round_number, tasks, time.time() + 3600, base)
        started = time.perf_counter()
        for task_id, task in tasks.items():
            message = Task(task_id, round_number, task.agent_id, time.time() + 3600, ModelRef("preresnet20", 10, 1, {}),
                           task.spec.to_dict(), None, {}, plan=task.plan, secure=True)
            self.rooms[task.agent_id].advertise(message, self.update_of(task_id, task.agent_id, round_number), 2,
                                                lambda _answer: None)
        senders = len(self.names) - len(self.dropped)
        self.wait_for(senders)
        uploaded = time.perf_counter()
        for update in self.arrived:
            aggregate.add(self.room.unpack(update, tasks[update.task_id]))
        aggregate.result()  # asks for the shares back and unmasks
        done = time.perf_counter()
        record = self.room.settle(round_number) or {}
        assert record.get("failure") is None, record
        phases = record["seconds"]
        return {"seconds": done - started, "adverts": phases["adverts"], "shares": phases["shares"],
                "uploads": uploaded - started - phases["adverts"] - phases["shares"], "unmask": phases["unmask"],
                "bytes": sum(self.bytes.values()) / len(self.names)}

    def plain_round(self, round_number: int) -> dict[str, float]:
        tasks = self.tasks(round_number, secure=False)
        self.bytes.clear()
        self.arrived = []
        aggregate = RoundAggregate(self.states, lambda _result: 1.0, list(self.family.classifier_keys()))
        started = time.perf_counter()
        for task_id, task in tasks.items():
            self.sender(task.agent_id)(self.update_of(task_id, task.agent_id, round_number))
        self.wait_for(len(self.names))
        for update in self.arrived:
            spec = self.specs[update.agent_id]
            index_map = self.family.index_map(spec)
            state = {key: torch.from_numpy(np.array(value)) for key, value in update.weights.items()}
            aggregate.add(TaskResult(tasks[update.task_id], spec, state,
                                     {key: index_map[key] for key in state}, 100, list(range(10))))
        aggregate.result()
        return {"seconds": time.perf_counter() - started, "bytes": sum(self.bytes.values()) / len(self.names)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="8,100")
    parser.add_argument("--dropout", default="0,0.1")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    broker = start_broker("mosquitto")
    try:
        config = BrokerConfig(host=broker.host, port=broker.port)
        print("| devices | dropped | plain s | secure s | adverts | shares | uploads | unmask | plain MB/device | "
              "secure MB/device |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        round_number = 0
        for devices in (int(value) for value in args.devices.split(",")):
            fleet = Fleet(config, devices, seed=devices)
            fleet.coordinator.start()
            fleet.devices.start()
            try:
                for dropout in (float(value) for value in args.dropout.split(",")):
                    plain, secure = [], []
                    for repeat in range(args.repeat):
                        round_number += 1
                        plain.append(fleet.plain_round(round_number))
                        round_number += 1
                        secure.append(fleet.secure_round(round_number, dropout, seed=repeat))
                    best_plain = min(plain, key=lambda entry: entry["seconds"])
                    best = min(secure, key=lambda entry: entry["seconds"])
                    print(f"| {devices} | {len(fleet.dropped)} | {best_plain['seconds']:.2f} | {best['seconds']:.2f} | "
                          f"{best['adverts']:.2f} | {best['shares']:.2f} | {best['uploads']:.2f} | "
                          f"{best['unmask']:.2f} | {best_plain['bytes'] / 1e6:.2f} | {best['bytes'] / 1e6:.2f} |",
                          flush=True)
            finally:
                fleet.devices.stop()
                fleet.coordinator.stop()
    finally:
        broker.stop()
    print("(every device in this process, on one connection: the devices' seconds add up; see the docstring)")


if __name__ == "__main__":
    main()
