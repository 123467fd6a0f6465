"""FedFit on a 3-node RabbitMQ cluster (``loadrig.rabbitmq``): what the broker does with what FedFit needs, and
federations whose agents are spread over the nodes.

Modes (each starts its own cluster on loopback and stops it, leaving no process behind):

- ``features``: probes, with bare MQTT 3.1.1 clients on different nodes, what FedFit relies on: the protocol
  versions, retained messages (exact and wildcard subscriptions, across nodes), the Last Will, QoS 1 persistent
  sessions across nodes, message sizes, ordering per topic, client-id takeover across nodes, and the ACL (topic
  permissions) of a secured cluster. One line per finding.
- ``federation``: a coordinator on node 0 and ``--agents`` real agents (``EdgeAgent``, training on digits shards)
  spread round-robin over the nodes, ``--rounds`` HeteroFL rounds with a small CNN; prints each round's time and
  whether every update was aggregated, and how long the coordinator took to see the fleet. ``--agents-first``
  starts the agents before the coordinator (as after a coordinator restart): RabbitMQ sends no retained status to
  the coordinator's wildcard subscription, so it learns of each agent when the agent answers the coordinator's
  "online" status with its own (before that answer existed: at the agent's next periodic status,
  ``--status-interval``). ``--mosquitto`` runs the same federation on one secured mosquitto too, for comparison.
- ``load``: ``--agents`` synthetic agents (``loadrig.load``: they answer tasks with updates of the right shape
  without training) spread over the nodes, driving one coordinator on node 0 for ``--rounds`` rounds; prints the
  round times, the coordinator's RSS and each node's CPU and RSS. ``--mosquitto`` runs the same load over one
  mosquitto afterwards.

Run: ``.venv/bin/python benchmarks/broker_cluster.py features|federation|load [options]``.

Measured here (RabbitMQ 3.10.8, 2 cores shared with other work: the times are noisy): the cluster starts in 20-45 s;
``federation --mosquitto``: 6 of 6 updates aggregated in each of 3 rounds on both, the same accuracies, rounds of
30-42 s on the cluster and 25-36 s on mosquitto (training dominates); with ``--agents-first`` the coordinator saw
the fleet after 30.1 s on the cluster (the agents' next status) and 0.1 s on mosquitto (retained statuses); since
agents answer the coordinator's status, 0.2 s on the cluster too. ``load --agents 1000``, before the registry,
lock, heap and pacing fixes: rounds 826.6 s (600 s of it waiting for the fleet to settle), 210.6 s and 213.7 s;
coordinator peak RSS 4,009 MiB. After them, on a quiet machine: 3000 of 3000 updates aggregated; rounds 113.6, 88.8
and 97.4 s; coordinator 52-58 CPU s a round, peak RSS 3,638 MiB, 834-839 MiB after each round; nodes 157 / 57 / 57
CPU seconds and 1,804 / 1,738 / 1,789 MiB (``fleet_load.py`` on one mosquitto: rounds 47-61 s, broker 17 CPU s).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import _shared  # noqa: F401 - the repository's root on sys.path, for loadrig
import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion

from common.cores import available_cores
from common.data import load_dataset, parse_partition, partition_indices
from common.mqtt_link import BrokerConfig, MqttLink
from coordinator.config import CoordinatorConfig, DataConfig, DeploymentConfig, ModelConfig, RecipeConfig
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from fedfit.sim.broker import Broker, BrokerStartError, start_mosquitto
from fedfit.sim.budgets import device_budgets
from fedfit.sim.harness import budget_anchor
from loadrig.load import LoadOptions, format_outcome, run_load
from loadrig.rabbitmq import RabbitCluster, start_rabbitmq_cluster

WAIT_S = 10.0
MIB = 2**20


# ------------------------------------------------------------------------------------------------ bare client
class Client311:
    """A bare MQTT 3.1.1 client (no reconnection) that queues what it receives, with the retain flag."""

    def __init__(self, config: BrokerConfig, client_id: str, *, clean: bool = True,
                 will: tuple[str, bytes] | None = None, keepalive: int = 10) -> None:
        self.inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self.connected = threading.Event()
        self.closed = threading.Event()
        self.subacked = threading.Event()
        self.connack = ""
        self.session_present = False
        self.granted: list[str] = []
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                             clean_session=clean, reconnect_on_failure=False)
        login = config.login()
        if login is not None:
            client.username_pw_set(*login)
        if config.tls:
            client.tls_set(ca_certs=config.ca_file)
        if will is not None:
            client.will_set(will[0], will[1], qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = lambda *_args: self.closed.set()
        client.on_subscribe = self._on_subscribe
        client.on_message = lambda _c, _u, m: self.inbox.put((m.topic, bytes(m.payload), bool(m.retain)))
        client.max_inflight_messages_set(100)
        self.client = client
        client.connect(config.host, config.port, keepalive=keepalive)
        client.loop_start()
        if not self.connected.wait(WAIT_S):
            raise RuntimeError(f"{client_id}: no CONNACK from {config}")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connack = str(reason)
        self.session_present = bool(flags.session_present)
        self.connected.set()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, properties: Any) -> None:
        self.granted = [str(code) for code in codes]
        self.subacked.set()

    def subscribe(self, topic: str) -> str:
        """Subscribe at QoS 1: the SUBACK's code, or "connection closed" / "no SUBACK"."""
        self.subacked.clear()
        self.client.subscribe(topic, qos=1)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not self.subacked.is_set() and not self.closed.is_set():
            self.subacked.wait(0.05)
        if self.subacked.is_set():
            return self.granted[0]
        return "connection closed" if self.closed.is_set() else "no SUBACK"

    def publish(self, topic: str, payload: bytes, retain: bool = False, wait: bool = True) -> str:
        """Publish at QoS 1; "acked", "connection closed" or "no PUBACK" (or "queued" without ``wait``)."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        if not wait:
            return "queued"
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not info.is_published() and not self.closed.is_set():
            time.sleep(0.01)
        if info.is_published():
            return "acked"
        return "connection closed" if self.closed.is_set() else "no PUBACK"

    def take(self, count: int, timeout: float = WAIT_S) -> list[tuple[str, bytes, bool]]:
        """Up to ``count`` messages received within ``timeout`` seconds."""
        got: list[tuple[str, bytes, bool]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                got.append(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return got

    def until_marker(self, marker: bytes, timeout: float = WAIT_S) -> list[tuple[str, bytes, bool]]:
        """Messages received before ``marker`` arrives (the broker sends retained messages right after the SUBACK,
        before anything published after it): what a subscription got without guessing a wait."""
        got: list[tuple[str, bytes, bool]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if message[1] == marker:
                return got
            got.append(message)
        raise RuntimeError("the marker did not come back")

    def drop(self) -> None:
        """Cut the TCP connection without a DISCONNECT (what a device losing power does): its Will goes out."""
        sock = self.client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the FIN goes out now; the broker sees the connection end
        self.closed.wait(WAIT_S)
        self.client.loop_stop()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# --------------------------------------------------------------------------------------------------- features
def probe_features(cluster: RabbitCluster) -> None:
    """One line per finding: what a 3-node RabbitMQ does with each thing FedFit relies on."""
    federation = cluster.federation or "probe"
    cluster.add_logins(["probe"])  # FedFit's device permissions, widened below for the generic probes
    cluster.ctl("set_topic_permissions", "-p", "/", "probe", "amq.topic", ".*", ".*")
    node = [cluster.client_config("probe", index) for index in range(len(cluster.nodes))]
    print(f"RabbitMQ {cluster.version}, {len(cluster.nodes)} nodes {cluster.running_nodes()}, MQTT "
          f"{'TLS ' if cluster.tls else ''}ports {cluster.ports}")
    for probe in (probe_protocol, probe_retained, probe_will, probe_sessions, probe_sizes, probe_ordering):
        probe(node)
    print(f"client id taken over from node 1 while connected on node 0: first connection "
          f"{'closed' if _takeover(node[0], node[1]) else 'NOT closed'}")
    if cluster.secured:
        probe_acl(cluster, federation)
    if len(node) > 2:
        probe_node_failure(cluster, node)


def probe_protocol(node: list[BrokerConfig]) -> None:
    """What an MQTT 5 CONNECT gets, and how long FedFit's link takes to fall back to 3.1.1."""
    raw = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="probe-v5", protocol=mqtt.MQTTv5,
                      reconnect_on_failure=False)
    login = node[0].login()
    assert login is not None
    raw.username_pw_set(*login)
    raw.tls_set(ca_certs=node[0].ca_file) if node[0].tls else None
    answer: list[str] = []
    done = threading.Event()

    def answered(what: str) -> None:
        answer.append(what)
        done.set()

    raw.on_connect = lambda *a: answered(f"CONNACK {a[3]}")
    raw.on_disconnect = lambda *a: answered("connection closed before CONNACK")
    raw.connect(node[0].host, node[0].port)
    raw.loop_start()
    done.wait(WAIT_S)
    raw.loop_stop()
    started = time.monotonic()
    link = MqttLink(client_id="probe-link", broker=node[0], subscriptions=["probe/link"], handler=lambda t, p: None)
    link.start(30)
    print(f"protocol: an MQTT 5 CONNECT gets: {answer[0] if answer else 'nothing'}; FedFit's link connected with "
          f"{link.protocol_name} after {time.monotonic() - started:.1f} s (MQTT 5 tried first)")
    link.stop()


def probe_retained(node: list[BrokerConfig]) -> None:
    """Retained messages: exact and wildcard subscriptions, on the node that has it and on another."""
    publisher = Client311(node[0], "probe-retain-pub")
    publisher.publish("probe/retained/a", b"kept", retain=True)
    publisher.close()
    for label, index, topic in (("exact topic, same node", 0, "probe/retained/a"),
                                ("exact topic, other node", 1, "probe/retained/a"),
                                ("wildcard, same node", 0, "probe/retained/+")):
        subscriber = Client311(node[index], f"probe-retain-{index}-{len(topic)}")
        subscriber.subscribe(topic)
        subscriber.publish("probe/retained/a", b"marker")
        got = subscriber.until_marker(b"marker")
        print(f"retained ({label}): {'delivered' if any(m[2] and m[1] == b'kept' for m in got) else 'NOT delivered'}")
        subscriber.close()
    clearer = Client311(node[0], "probe-retain-clear")
    clearer.publish("probe/retained/a", b"", retain=True)
    clearer.close()


def probe_will(node: list[BrokerConfig]) -> None:
    """The Last Will: the client on the last node drops; a subscriber on node 0."""
    watcher = Client311(node[0], "probe-will-watch")
    watcher.subscribe("probe/will/#")
    dying = Client311(node[-1], "probe-will-dying", will=("probe/will/status", b"offline"))
    dropped = time.monotonic()
    dying.drop()
    will = [m for m in watcher.take(1, 60.0) if m[1] == b"offline"]
    print(f"last will (client on node {len(node) - 1}, watcher on node 0): "
          f"{f'delivered after {time.monotonic() - dropped:.2f} s' if will else 'NOT delivered within 60 s'}")
    watcher.close()


def probe_sessions(node: list[BrokerConfig]) -> None:
    """Persistent sessions: subscribed on node 1, offline while the last node publishes, back on node 0 and 1."""
    for back_on in (0, 1):
        client_id = f"probe-session-{back_on}"
        sleeper = Client311(node[1], client_id, clean=False)
        sleeper.subscribe("probe/session/x")
        sleeper.close()
        sender = Client311(node[-1], f"probe-session-sender-{back_on}")
        for seq in range(3):
            sender.publish("probe/session/x", b"queued-%d" % seq)
        sender.close()
        returning = Client311(node[back_on], client_id, clean=False)
        got = returning.take(3, WAIT_S)
        print(f"persistent session (clean_session false, subscribed on node 1, 3 messages sent from node "
              f"{len(node) - 1} while offline, back on node {back_on}): session present "
              f"{returning.session_present}, {len(got)} of 3 delivered")
        returning.close()
        Client311(node[back_on], client_id, clean=True).close()  # ends the session (and its queue)


def probe_sizes(node: list[BrokerConfig]) -> None:
    """Message sizes: published on node 1, received on node 0."""
    receiver = Client311(node[0], "probe-size-rx", keepalive=120)
    receiver.subscribe("probe/size")
    sender = Client311(node[1], "probe-size-tx", keepalive=120)  # a long transfer on a busy machine
    for size in (1 * MIB, 16 * MIB, 64 * MIB, 130 * MIB):  # RabbitMQ's max_message_size: 128 MiB by default
        outcome = sender.publish("probe/size", b"s" * size)
        got = receiver.take(1, 60.0)
        print(f"message of {size // MIB} MiB (node 1 -> node 0): publish {outcome}, "
              f"{'received intact' if got and len(got[0][1]) == size else 'NOT received'}")
        if sender.closed.is_set():
            sender = Client311(node[1], "probe-size-tx", keepalive=120)
    sender.close()
    receiver.close()


def probe_ordering(node: list[BrokerConfig]) -> None:
    """Ordering: one publisher per node, 2000 QoS 1 messages each on its own topic, one subscriber on node 0."""
    count = 2000
    subscriber = Client311(node[0], "probe-order-rx")
    subscriber.subscribe("probe/order/#")
    senders = [Client311(config, f"probe-order-tx-{index}") for index, config in enumerate(node)]
    for seq in range(count):
        for index, sender in enumerate(senders):
            sender.publish(f"probe/order/{index}", seq.to_bytes(4, "big"), wait=False)
    received = subscriber.take(count * len(senders), 120.0)
    in_order = all(
        [int.from_bytes(m[1], "big") for m in received if m[0] == f"probe/order/{index}"] == list(range(count))
        for index in range(len(senders)))
    print(f"ordering: {len(received)} of {count * len(senders)} messages from {len(senders)} nodes received on node 0, "
          f"each topic in its publisher's order: {in_order}")
    for sender in senders:
        sender.close()
    subscriber.close()


def probe_node_failure(cluster: RabbitCluster, node: list[BrokerConfig]) -> None:
    """The last node stops with a client (and its Will) connected there: does the Will go out, do the others
    go on? (It runs last: the node stays down.)"""
    last = len(node) - 1
    watcher = Client311(node[0], "probe-down-watch")
    watcher.subscribe("probe/down/#")
    Client311(node[last], "probe-down-client", will=("probe/down/status", b"offline"))
    stopped = time.monotonic()
    cluster.stop_node(last)
    will = [m for m in watcher.take(1, 30.0) if m[1] == b"offline"]
    print(f"node {last} stopped ({time.monotonic() - stopped:.1f} s) with a client connected there: its Will "
          f"{'delivered' if will else 'NOT delivered within 30 s'} to node 0; running nodes now "
          f"{len(cluster.running_nodes())}")
    sender = Client311(node[1], "probe-down-sender")
    sender.publish("probe/down/after", b"still")
    got = watcher.take(1, WAIT_S)
    print(f"after the node stopped: node 1 -> node 0 {'delivered' if got else 'NOT delivered'}; a client id taken "
          f"over on the survivors: {'closed' if _takeover(node[0], node[1]) else 'NOT closed'}")
    sender.close()
    watcher.close()


def _takeover(first_node: BrokerConfig, second_node: BrokerConfig) -> bool:
    """Whether connecting with a client id already connected on another node closes the first connection."""
    first = Client311(first_node, "probe-twin-late")
    second = Client311(second_node, "probe-twin-late")
    closed = first.closed.wait(WAIT_S)
    second.close()
    return closed


def probe_acl(cluster: RabbitCluster, federation: str) -> None:
    """What the topic permissions let a device and the coordinator do, and how a refusal looks over MQTT 3.1.1."""
    prefix = f"fedfit/v1/{federation}"
    coordinator = Client311(cluster.coordinator_config(0), "probe-acl-coordinator")
    looker = Client311(cluster.coordinator_config(0), "probe-acl-look")
    print(f"acl: coordinator subscribes {prefix}/agents/+/update: {coordinator.subscribe(f'{prefix}/agents/+/update')}; "
          f"fedfit/v1/+/agents/+/status (every federation): {looker.subscribe('fedfit/v1/+/agents/+/status')}")
    device = Client311(cluster.client_config("pi-0", 1), "probe-acl-pi-0")
    print(f"acl: pi-0 publishes its own update: {device.publish(f'{prefix}/agents/pi-0/update', b'mine')}, "
          f"coordinator got it: {bool(coordinator.take(1, WAIT_S))}")
    print(f"acl: pi-0 subscribes to pi-1's tasks: {device.subscribe(f'{prefix}/agents/pi-1/task')}")
    device = Client311(cluster.client_config("pi-0", 1), "probe-acl-pi-0b")
    outcome = device.publish(f"{prefix}/agents/pi-1/update", b"forged")
    print(f"acl: pi-0 publishes as pi-1: {outcome}; coordinator got it: {bool(coordinator.take(1, 2.0))}")
    device = Client311(cluster.client_config("pi-0", 1), "probe-acl-pi-0c")
    print(f"acl: pi-0 publishes a task for itself: {device.publish(f'{prefix}/agents/pi-0/task', b'x')}")
    for client in (device, looker, coordinator):
        client.close()


# ------------------------------------------------------------------------------------------------- federation
def small_config(federation: str, rounds: int, agents: int, state_dir: Path) -> CoordinatorConfig:
    """HeteroFL on digits with a small CNN: quick rounds, so that the broker's part shows."""
    return CoordinatorConfig(
        federation=federation, algorithm="heterofl", rounds=rounds, min_agents=agents, seed=0,
        model=ModelConfig(family="cnn", options={"hidden": [16, 32, 64]}),
        data=DataConfig(dataset="digits", bn_samples=500),
        recipe=RecipeConfig(epochs=1, batch_size=16, lr=0.05),
        levels=[1.0, 0.5, 0.25], round_timeout_s=600.0, wait_for_agents_s=120.0, state_dir=str(state_dir),
        deployment=DeploymentConfig(deliver=False))  # the broker's part of the rounds, not the models' delivery


def run_federation(brokers: Sequence[Broker], *, agents: int, rounds: int, agents_first: bool,
                   status_interval: float, label: str) -> dict[str, Any]:
    """A coordinator on ``brokers[0]`` and ``agents`` agents, agent i on ``brokers[i % len(brokers)]``; returns what
    it measured."""
    work = Path(tempfile.mkdtemp(prefix="fedfit-cluster-fed-"))
    federation = "cluster"
    config = small_config(federation, rounds, agents, work / "coordinator")
    config = replace(config, broker=brokers[0].coordinator_config())
    dataset = load_dataset("digits", None)
    coordinator = Coordinator(config, dataset=dataset)
    schedules = device_budgets("widths:1,1/2,1/4", agents, budget_anchor(coordinator), 0, 0.0)
    shards = partition_indices(dataset.y_train, agents, parse_partition("iid"), 0)
    names = [f"pi-{index:03d}" for index in range(agents)]
    for broker in brokers[:1]:
        broker.add_logins(names)
    cores = available_cores()
    pool = ThreadPoolExecutor(max_workers=cores, thread_name_prefix="train")
    fleet = [EdgeAgent(AgentConfig(agent_id=name, federation=federation,
                                   broker=brokers[index % len(brokers)].client_config(name),
                                   device_kind=schedules[index].tier.name, budget_bytes=schedules[index](0),
                                   data=AgentDataConfig(dataset="digits", num_shards=agents, shard=index),
                                   torch_threads=1, state_dir=str(work / "agents"), status_interval_s=status_interval),
                       to_local_data(dataset.x_train[shard], dataset.y_train[shard]), executor=pool,
                       budget_schedule=schedules[index])
             for index, (name, shard) in enumerate(zip(names, shards))]
    result: dict[str, Any] = {"label": label}
    try:
        def start_fleet() -> None:
            with ThreadPoolExecutor(max_workers=8) as connect:
                for future in [connect.submit(agent.start) for agent in fleet]:
                    future.result()

        if agents_first:
            start_fleet()
        started = time.monotonic()
        coordinator.start()
        if not agents_first:
            start_fleet()
        deadline = started + 4 * status_interval + 60.0
        while len(coordinator.registry.online()) < agents and time.monotonic() < deadline:
            time.sleep(0.05)
        result["fleet_seen_s"] = time.monotonic() - started
        result["fleet_seen"] = len(coordinator.registry.online())
        began = time.monotonic()
        outcome = coordinator.run()
        result["run_s"] = time.monotonic() - began
        result["rounds"] = [(r.round, r.seconds, r.participants, r.selected,
                             sum(t.status in ("ok", "adapted") for t in r.tasks), len(r.tasks), r.global_accuracy)
                            for r in outcome]
        result["rejected"] = coordinator.rejected_messages + sum(agent.rejected_messages for agent in fleet)
        result["coordinator_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return result
    finally:
        for agent in fleet:
            agent.stop()
        coordinator.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(work, ignore_errors=True)


def print_federation(result: dict[str, Any], agents: int, nodes: int) -> None:
    print(f"{result['label']}: the coordinator saw {result['fleet_seen']} of {agents} agents after "
          f"{result['fleet_seen_s']:.1f} s")
    for number, seconds, participants, selected, aggregated, tasks, accuracy in result["rounds"]:
        print(f"  round {number}: {seconds:6.2f} s, {participants}/{selected} participants, {aggregated} of {tasks} "
              f"updates aggregated, global accuracy {accuracy:.3f}")
    every = all(aggregated == tasks == agents for *_, aggregated, tasks, _ in result["rounds"])
    print(f"  every update aggregated in every round: {every}; rejected messages: {result['rejected']}; "
          f"{len(result['rounds'])} rounds in {result['run_s']:.1f} s (agents over {nodes} broker"
          f"{'s' * (nodes > 1)})")


# ------------------------------------------------------------------------------------------------------- load
class NodeUsage:
    """CPU seconds and peak RSS of every process of the cluster's nodes, sampled while a run goes on."""

    def __init__(self, cluster: RabbitCluster, every: float = 0.5) -> None:
        self.every = every
        self.processes = [psutil.Process(node.process.pid) for node in cluster.nodes if node.process is not None]
        self.peak_rss = [0] * len(self.processes)
        self._start_cpu = [self._cpu(process) for process in self.processes]
        self.cpu = [0.0] * len(self.processes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-usage", daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(process: psutil.Process) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return [process, *process.children(recursive=True)]
        return []

    def _cpu(self, process: psutil.Process) -> float:
        total = 0.0
        for member in self._tree(process):
            with contextlib.suppress(psutil.Error):
                times = member.cpu_times()
                total += times.user + times.system
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for index, process in enumerate(self.processes):
                rss = 0
                for member in self._tree(process):
                    with contextlib.suppress(psutil.Error):
                        rss += member.memory_info().rss
                self.peak_rss[index] = max(self.peak_rss[index], rss)
                self.cpu[index] = self._cpu(process) - self._start_cpu[index]

    def stop(self) -> str:
        """Stop sampling; one line of what each node used."""
        self._stop.set()
        self._thread.join(5.0)
        return "RabbitMQ nodes: " + "; ".join(f"node {index} CPU {cpu:.1f} s, peak RSS {rss / MIB:,.0f} MiB"
                                               for index, (cpu, rss) in enumerate(zip(self.cpu, self.peak_rss)))


def run_load_mode(cluster: RabbitCluster, agents: int, rounds: int, workers: int, grants: bool = True) -> bool:
    """``agents`` synthetic agents spread over the nodes (agent i on node i % nodes), one coordinator on node 0
    (``grants``: it grants uploads, the default); whether every round aggregated an update from every agent."""
    addresses = [f"{cluster.host}:{port}" for port in cluster.ports]
    options = LoadOptions(agents=agents, rounds=rounds, workers=workers, brokers=addresses,
                          coordinator_broker=addresses[0], protocol="3.1.1",
                          settings={} if grants else {"uploads": {"grant": False}})
    usage = NodeUsage(cluster)
    try:
        outcome = run_load(options, progress=sys.stderr)
    finally:
        used = usage.stop()
    print(format_outcome(outcome))
    print(used)
    print(f"every round aggregated an update from every agent: {outcome.complete}", flush=True)
    return outcome.complete


def run_load_on_mosquitto(agents: int, rounds: int, workers: int, grants: bool = True) -> bool:
    """The same load over one mosquitto (``run_load`` starts an anonymous one), agents on MQTT 3.1.1 as above."""
    outcome = run_load(LoadOptions(agents=agents, rounds=rounds, workers=workers, protocol="3.1.1",
                                   settings={} if grants else {"uploads": {"grant": False}}),
                       progress=sys.stderr)
    print(format_outcome(outcome))
    print(f"every round aggregated an update from every agent: {outcome.complete}", flush=True)
    return outcome.complete


def run_mode(args: argparse.Namespace, cluster: RabbitCluster) -> bool:
    """Run ``args.mode`` on the cluster; whether it went as it should (load: every update aggregated)."""
    if args.mode == "features":
        probe_features(cluster)
        return True
    if args.mode == "load":
        return run_load_mode(cluster, args.agents or 1000, args.rounds, args.workers, args.grants)
    agents = args.agents or 6
    result = run_federation(cluster.brokers, agents=agents, rounds=args.rounds, agents_first=args.agents_first,
                            status_interval=args.status_interval, label=f"RabbitMQ cluster ({args.nodes} nodes)")
    print_federation(result, agents, args.nodes)
    return True


def run_mosquitto(args: argparse.Namespace) -> bool:
    """The same federation or load over one mosquitto, for comparison."""
    if args.mode == "load":
        return run_load_on_mosquitto(args.agents or 1000, args.rounds, args.workers, args.grants)
    agents = args.agents or 6
    broker = start_mosquitto(federation=None if args.insecure else "cluster")
    try:
        result = run_federation([broker], agents=agents, rounds=args.rounds, agents_first=args.agents_first,
                                status_interval=args.status_interval, label=f"mosquitto {broker.version} (one broker)")
    finally:
        broker.stop()
    print_federation(result, agents, 1)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("features", "federation", "load"))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--agents", type=int, default=None, help="default: 6 (federation), 1000 (load)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents-first", action="store_true", help="start the agents before the coordinator")
    parser.add_argument("--status-interval", type=float, default=30.0, help="agents' status_interval_s (default 30)")
    parser.add_argument("--mosquitto", action="store_true",
                        help="federation, load: run the same on one mosquitto afterwards, for comparison")
    parser.add_argument("--insecure", action="store_true", help="no TLS, no logins (anonymous clients; always so for "
                                                                "load)")
    parser.add_argument("--workers", type=int, default=2, help="load: processes the synthetic agents run in")
    parser.add_argument("--grants", action=argparse.BooleanOptionalAction, default=True,
                        help="load: the coordinator grants uploads (--no-grants: every agent sends at once, as "
                             "before protocol revision 6)")
    parser.add_argument("--memory-limit", default="2GB", help="each node's memory high watermark (default 2GB)")
    args = parser.parse_args()
    started = time.monotonic()
    # The load mode's agents log in anonymously (loadrig.load takes HOST:PORT brokers).
    secured = not args.insecure and args.mode != "load"
    try:
        cluster = start_rabbitmq_cluster(args.nodes, federation="cluster" if secured else None,
                                         memory_limit=args.memory_limit)
    except (BrokerStartError, ValueError) as exc:  # not installed, a node that would not start: one sentence
        parser.error(str(exc))
    print(f"cluster of {args.nodes} RabbitMQ {cluster.version} nodes up in {time.monotonic() - started:.1f} s "
          f"(MQTT ports {cluster.ports}, {'secured: TLS, logins, topic permissions' if cluster.secured else 'open'}; "
          f"{available_cores()} cores here, shared: timings are noisy)", flush=True)
    try:
        passed = run_mode(args, cluster)
    finally:
        cluster.stop()
    if args.mosquitto and args.mode != "features":
        passed = run_mosquitto(args) and passed
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
