"""Every misconfiguration an operator can make ends in one sentence within seconds, not a silent wait. Over a
real mosquitto: secured as `fedfit broker init` makes it (its ACL refuses what a misconfigured daemon publishes),
or open (where only what the daemons see can tell)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from common.data import load_dataset
from common.mqtt_link import BrokerRefused
from coordinator import fleet as coordinator_fleet
from coordinator.daemon import Coordinator, NoAgentsError
from edge_agent.config import AgentConfig, AgentDataConfig
from edge_agent.daemon import EdgeAgent
from edge_agent.runner import LocalData
from fedfit.sim.broker import Broker

from .conftest import SecuredBroker, on_broker, tiny_config

pytestmark = [pytest.mark.broker]

#: What the done-when allows for any misconfiguration to be said.
SAY_IT_WITHIN_S = 30.0


def agent(broker_config, agent_id: str, federation: str, tmp_path, shape: tuple[int, int, int] = (1, 8, 8)
          ) -> EdgeAgent:
    config = AgentConfig(agent_id=agent_id, federation=federation, broker=broker_config,
                         data=AgentDataConfig(dataset="digits"), state_dir=str(tmp_path / agent_id), torch_threads=1)
    return EdgeAgent(config, LocalData(torch.zeros(4, *shape), torch.tensor([0, 1, 0, 1])))


def test_an_agent_whose_id_is_not_its_login_stops_with_one_sentence(secured_mosquitto: SecuredBroker,
                                                                     tmp_path) -> None:
    mosquitto = secured_mosquitto("lab")
    wrong = agent(mosquitto.client_config("pi-01"), "pi-02", "lab", tmp_path)  # pi-01's login, pi-02's id
    started = time.monotonic()
    try:
        # Its first publish (the start-up check for another process of its id) is refused by the ACL.
        with pytest.raises(BrokerRefused) as refused:
            wrong.start()
        assert time.monotonic() - started < SAY_IT_WITHIN_S
        sentence = str(refused.value)
        assert "\n" not in sentence
        assert sentence.startswith(f"the MQTT broker at {mosquitto.host}:{mosquitto.port} refused to let user "
                                   f"'pi-01' publish on fedfit/v1/lab/agents/pi-02/status (Not authorized)")
        assert "agent_id ('pi-02') must be its login's username" in sentence
    finally:
        wrong.stop()


def test_a_running_agent_refused_on_its_own_topics_stops_with_one_sentence(secured_mosquitto: SecuredBroker,
                                                                            tmp_path) -> None:
    mosquitto = secured_mosquitto("lab")
    member = agent(mosquitto.client_config("pi-01"), "pi-01", "lab", tmp_path)
    member.start()
    try:
        # As if the broker's ACL changed under it: its next status goes to a topic it may not use.
        member.topics = replace(member.topics, federation="default")
        member.publish_status()
        assert member._stop.wait(SAY_IT_WITHIN_S)
        assert "its federation ('lab') the one the broker was made for" in (member.fatal or "")
    finally:
        member.stop()


def test_an_agent_of_another_federation_stops_with_one_sentence(secured_mosquitto: SecuredBroker, tmp_path) -> None:
    mosquitto = secured_mosquitto("lab")
    wrong = agent(mosquitto.client_config("pi-01"), "pi-01", "default", tmp_path)
    try:
        with pytest.raises(BrokerRefused, match=r"its federation \('default'\) the one the broker was made for"):
            wrong.start()
    finally:
        wrong.stop()


def test_a_coordinator_of_another_federation_stops_with_one_sentence(secured_mosquitto: SecuredBroker,
                                                                      tmp_path) -> None:
    mosquitto = secured_mosquitto("lab")
    config = replace(on_broker(tiny_config(state_dir=str(tmp_path / "coordinator")), mosquitto),
                     federation="default")  # what a broker section without `federation:` gives
    coordinator = Coordinator(config, dataset=load_dataset("digits"))
    started = time.monotonic()
    coordinator.start()
    try:
        with pytest.raises(BrokerRefused, match=r"^the MQTT broker at .* refused to let user 'coordinator' publish "
                                                r"on fedfit/v1/default/coordinator/status \(Not authorized\): "
                                                r"federation \('default'\) must be the one the broker was made for"):
            coordinator.run()
        assert time.monotonic() - started < SAY_IT_WITHIN_S
    finally:
        coordinator.stop()


def test_a_coordinator_without_agents_of_its_federation_names_the_ones_the_broker_shows(
        mosquitto: Broker, tmp_path, monkeypatch) -> None:
    import structlog

    monkeypatch.setattr(coordinator_fleet, "FEDERATIONS_CHECK_S", 1.0)
    others = [agent(mosquitto.client_config(name), name, "lab", tmp_path) for name in ("pi-01", "pi-02")]
    for other in others:
        other.start()
    config = on_broker(tiny_config(state_dir=str(tmp_path / "coordinator"), wait_for_agents_s=4.0), mosquitto)
    coordinator = Coordinator(config, dataset=load_dataset("digits"))  # federation 'default'
    coordinator.start()
    try:
        with structlog.testing.capture_logs() as logs, pytest.raises(
                NoAgentsError, match=r"^no agent of federation 'default' came online within 4 s; the broker shows "
                                     r"agents of federation 'lab' \(2 agents\): set the same federation"):
            coordinator.run()
        said = [entry for entry in logs if entry["event"] == "no_agents_of_this_federation"]
        assert said and "the broker shows agents of federation 'lab' (2 agents)" in said[0]["message"]
    finally:
        coordinator.stop()
        for other in others:
            other.stop()


def test_a_coordinator_refuses_agents_whose_data_does_not_fit_its_model(secured_mosquitto: SecuredBroker,
                                                                        tmp_path) -> None:
    mosquitto = secured_mosquitto("lab")
    config = on_broker(tiny_config(federation="lab", state_dir=str(tmp_path / "coordinator")), mosquitto)
    fleet = [agent(mosquitto.client_config(name), name, "lab", tmp_path, shape=(1, 28, 28))  # Fashion-MNIST's
             for name in ("pi-01", "pi-02")]
    for member in fleet:
        member.start()
    coordinator = Coordinator(config, dataset=load_dataset("digits"))  # 8x8 images
    coordinator.start()
    failure: list[BaseException] = []
    runner = threading.Thread(target=lambda: _capture(coordinator.run, failure))
    started = time.monotonic()
    runner.start()
    try:
        runner.join(SAY_IT_WITHIN_S)
        assert not runner.is_alive() and time.monotonic() - started < SAY_IT_WITHIN_S
        assert len(failure) == 1 and isinstance(failure[0], NoAgentsError)
        assert "fits the model, so no round can be planned: agent 'pi-01': its samples are 1x28x28" in str(failure[0])
        assert all(member.tasks_done == 0 for member in fleet)
    finally:
        coordinator.stop()
        for member in fleet:
            member.stop()


def _capture(run, failures: list[BaseException]) -> None:
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        failures.append(exc)
