"""FedFit unchanged on a 3-node RabbitMQ cluster (``loadrig.rabbitmq``): a coordinator on one node, agents on
the others, secured (TLS, a login per client, topic permissions as FedFit's ACL gives), over MQTT 3.1.1 (RabbitMQ
3.10 speaks no MQTT 5). Skipped where rabbitmq-server is not installed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from common.data import load_dataset, parse_partition, partition_indices
from common.mqtt_link import BrokerConfig, BrokerRefused, MqttLink
from coordinator.config import RecipeConfig
from coordinator.daemon import Coordinator
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.data_source import to_local_data
from loadrig.rabbitmq import (
    RabbitCluster,
    find_rabbitmq,
    routing_key,
    start_rabbitmq_cluster,
    topic_permissions,
)

from ..integration.conftest import tiny_config

FEDERATION = "cluster"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    if find_rabbitmq() is None:
        pytest.skip("rabbitmq-server is not installed (apt-get install rabbitmq-server): the broker-cluster test "
                    "starts a 3-node RabbitMQ cluster")
    started = start_rabbitmq_cluster(3, federation=FEDERATION)
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.broker
@pytest.mark.slow
def test_a_federation_runs_with_its_agents_on_different_nodes(cluster: RabbitCluster, tmp_path) -> None:
    assert len(cluster.running_nodes()) == 3
    config = tiny_config(federation=FEDERATION, rounds=2, min_agents=3, state_dir=str(tmp_path / "coordinator"),
                         recipe=RecipeConfig(epochs=1, batch_size=32, lr=0.05))  # the broker's part is the point
    config = replace(config, broker=cluster.coordinator_config(0))
    dataset = load_dataset("digits")
    names = ["pi-0", "pi-1", "pi-2"]
    shards = partition_indices(dataset.y_train, len(names), parse_partition("iid"), 0)
    cluster.add_logins(names)
    # Agent i on node i: the coordinator shares node 0 with one of them; the others reach it through the cluster.
    fleet = [EdgeAgent(AgentConfig(agent_id=name, federation=FEDERATION, broker=cluster.client_config(name, node=index),
                                   data=AgentDataConfig(dataset="digits"), state_dir=str(tmp_path / "agents"),
                                   torch_threads=1),
                       to_local_data(dataset.x_train[shard], dataset.y_train[shard]))
             for index, (name, shard) in enumerate(zip(names, shards))]
    assert len({agent.config.broker.port for agent in fleet}) == 3
    coordinator = Coordinator(config, dataset=dataset)
    try:
        coordinator.start()
        for agent in fleet:
            agent.start()
        rounds = coordinator.run()
    finally:
        for agent in fleet:
            agent.stop()
        coordinator.stop()
    assert coordinator.link.protocol_name == "MQTT 3.1.1"  # it tried MQTT 5 first and fell back
    assert all(agent.link.protocol_name == "MQTT 3.1.1" for agent in fleet)
    assert [r.round for r in rounds] == [1, 2]
    for result in rounds:
        assert result.participants == 3, result
        assert sorted(task.agent for task in result.tasks) == names
        assert {task.status for task in result.tasks} == {"ok"}, result.tasks
    assert coordinator.rejected_messages == 0 and all(agent.rejected_messages == 0 for agent in fleet)


def _connect(config: BrokerConfig, client_id: str) -> tuple[mqtt.Client, threading.Event]:
    """A bare MQTT 3.1.1 client logged in as ``config`` says; the event is set when its connection ends."""
    connected, closed = threading.Event(), threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311,
                         reconnect_on_failure=False)
    login = config.login()
    assert login is not None
    client.username_pw_set(*login)
    client.tls_set(ca_certs=config.ca_file)
    client.on_connect = lambda *args: connected.set()
    client.on_disconnect = lambda *args: closed.set()
    client.connect(config.host, config.port)
    client.loop_start()
    assert connected.wait(30)
    return client, closed


@pytest.mark.broker
@pytest.mark.slow
def test_a_device_cannot_publish_as_another(cluster: RabbitCluster) -> None:
    cluster.add_logins(["pi-7"])
    prefix = f"fedfit/v1/{FEDERATION}/agents"
    honest, honest_closed = _connect(cluster.client_config("pi-7", node=1), "fedfit-test-honest")
    info = honest.publish(f"{prefix}/pi-7/status", b"mine", qos=1)
    info.wait_for_publish(30)
    assert info.is_published() and not honest_closed.is_set()
    honest.disconnect()
    honest.loop_stop()
    forger, forger_closed = _connect(cluster.client_config("pi-7", node=2), "fedfit-test-forger")
    forger.publish(f"{prefix}/pi-8/update", b"forged", qos=1)
    # RabbitMQ's MQTT plugin answers a publish its topic permissions refuse by closing the connection.
    assert forger_closed.wait(30)
    forger.loop_stop()


@pytest.mark.broker
@pytest.mark.slow
def test_a_device_subscribing_where_it_may_not_read_is_told_at_once(cluster: RabbitCluster) -> None:
    # RabbitMQ closes the connection at a SUBSCRIBE its permissions refuse, without a SUBACK: the link says so at
    # once rather than waiting out its timeout.
    cluster.add_logins(["pi-9"])
    prying = MqttLink(client_id="pi-9", broker=cluster.client_config("pi-9", node=1),
                      subscriptions=[f"fedfit/v1/{FEDERATION}/agents/pi-10/task"], handler=lambda topic, payload: None)
    began = time.monotonic()
    with pytest.raises(BrokerRefused, match="closed the connection at its subscriptions"):
        prying.start(timeout=120)
    assert time.monotonic() - began < 60
    prying.stop()


@pytest.mark.broker
@pytest.mark.slow
def test_stopping_leaves_no_process_behind(cluster: RabbitCluster) -> None:
    processes = [node.process for node in cluster.nodes]
    assert cluster.processes()
    cluster.stop()  # (the fixture's stop does nothing more)
    assert all(process is not None and process.poll() is not None for process in processes)
    assert not cluster.processes()
    assert not cluster.workdir.exists()


def test_topic_permissions_pin_a_device_to_its_own_topics() -> None:
    device = topic_permissions("lab", "pi-0", "coordinator")
    assert device["write"] == r"^fedfit\.v1\.lab\.agents\.{username}\.(status|update)$"
    # An agent id holding "." gets its name written out: RabbitMQ would put it into the regex unescaped.
    dotted = topic_permissions("lab", "pi.kitchen", "coordinator")
    assert "{username}" not in dotted["write"] and r"pi/kitchen" in dotted["write"]
    assert routing_key("fedfit/v1/lab/agents/pi.kitchen/update") == "fedfit.v1.lab.agents.pi/kitchen.update"
    coordinator = topic_permissions("lab", "coordinator", "coordinator")
    assert "task" in coordinator["write"] and "update" in coordinator["read"]
