"""coordinator.model_courier: each agent is sent the largest trained model its memory runs, and the courier waits for
the agents to say they hold it."""

from __future__ import annotations

from pathlib import Path

import structlog

from common.model_package import InputSpec, Manifest, ManifestError, ModelEntry, write_file
from coordinator.config import CoordinatorConfig, DeploymentConfig
from coordinator.model_courier import ModelCourier, held_text, holds
from coordinator.registry import FleetRegistry
from edge_agent.model_store import ModelStore
from protocol import (
    MODEL_DELIVERY_REVISION,
    AgentReport,
    AgentStatus,
    Capabilities,
    ModelDelivery,
    Reassembler,
    Topics,
    decode,
)

LOG = structlog.get_logger()


def models(folder: Path) -> Manifest:
    """Three trained models needing 4000, 2000 and 900 bytes to run, and an untrained larger one."""
    entries = []
    for name, parameters, memory, trained in (("a", 100, 8000, False), ("b", 50, 4000, True), ("c", 30, 2000, True),
                                              ("d", 10, 900, True)):
        graph = write_file(folder, f"{name}/model.onnx", f"graph {name}".encode())
        state = write_file(folder, f"{name}/model.safetensors", f"state {name}".encode())
        entries.append(ModelEntry(name, {}, parameters, 1, 1, "last", (), (1,), 0.5, (0.5,), trained, False, memory,
                                  graph, state))
    return Manifest("heterofl", "cnn", {}, 10, 3, "run", InputSpec(1, 8, 8, 0.0, 1.0), tuple("0123456789"),
                    tuple(entries))


def status(agent: str, budget: int, revision: int = MODEL_DELIVERY_REVISION, model: str = "",
           refused: str = "") -> AgentStatus:
    capabilities = Capabilities("pi", 2**30, 2**30, budget, 10, [0, 1], (1, 8, 8), revision)
    return AgentStatus(agent, "online", capabilities, 1.0, "instance-" + agent,
                       AgentReport(1.0, model=model, model_refused=refused))


class FakeLink:
    """The broker and the agents behind it: each agent that answers stores its delivery and says so."""

    def __init__(self, registry: FleetRegistry, stores: dict[str, ModelStore], available: int = 2**30) -> None:
        self.registry = registry
        self.stores = stores
        self.available = available
        self.reassembler = Reassembler()
        self.topics: list[str] = []

    def publish(self, topic: str, payload: bytes) -> None:
        self.topics.append(topic)
        complete = self.reassembler.feed(payload, source="coordinator")
        if complete is None:
            return
        message = decode(complete, expected=ModelDelivery)
        assert isinstance(message, ModelDelivery)
        if message.agent_id in self.stores:
            budget = self.registry.get(message.agent_id).capabilities.budget_bytes  # type: ignore[union-attr]
            try:
                held = self.stores[message.agent_id].receive(message, available=self.available)
            except ManifestError as exc:  # as the agent's daemon answers a refusal
                self.registry.on_status(status(message.agent_id, budget, refused=f"{ModelStore.offered(message)}: {exc}"))
                return
            self.registry.on_status(status(message.agent_id, budget, model=held))


def test_each_agent_gets_the_largest_trained_model_it_runs_and_says_it_holds_it(tmp_path: Path) -> None:
    manifest = models(tmp_path / "models")
    registry = FleetRegistry()
    for agent, budget, revision in (("big", 10_000, 8), ("mid", 2500, 8), ("tiny", 500, 8), ("old", 10_000, 7),
                                    ("silent", 10_000, 8)):
        registry.on_status(status(agent, budget, revision))
    stores = {agent: ModelStore(tmp_path / agent, LOG) for agent in ("big", "mid")}
    link = FakeLink(registry, stores)
    config = CoordinatorConfig(state_dir=str(tmp_path), deployment=DeploymentConfig(wait_s=0.5))
    courier = ModelCourier(config, link, Topics("lab"), registry, LOG)  # type: ignore[arg-type]
    outcome = courier.deliver(manifest)
    assert outcome["big"] == held_text(manifest.model("b"))  # a is larger, but no device trained it
    assert outcome["mid"] == held_text(manifest.model("c")) and stores["mid"].held == outcome["mid"]
    assert outcome["tiny"] == "no trained model runs within its 0.0 MiB"
    assert outcome["old"] == "its protocol revision predates model delivery"
    assert outcome["silent"] == f"did not say it holds {held_text(manifest.model('b'))} within 0.5 s"
    assert set(link.topics) == {Topics("lab").agent_task(agent) for agent in ("big", "mid", "silent")}
    assert courier.outcome == outcome


def test_the_registry_keeps_the_model_an_agent_said_it_holds_until_it_restarts() -> None:
    registry = FleetRegistry()
    registry.on_status(status("pi", 100, model="b@1"))
    plain = status("pi", 100)
    registry.on_status(AgentStatus(plain.agent_id, "online", plain.capabilities, 2.0, plain.instance))  # no report
    assert registry.get("pi").model == "b@1"  # type: ignore[union-attr]
    registry.on_status(AgentStatus("pi", "online", plain.capabilities, 3.0, "another-process"))
    assert registry.get("pi").model == ""  # type: ignore[union-attr]
    assert registry.wait_until(lambda records: "pi" in records, 0.1)
    assert not registry.wait_until(lambda records: records["pi"].model == "x", 0.05)


def test_without_reports_the_courier_sends_and_says_it_cannot_confirm(tmp_path: Path) -> None:
    manifest = models(tmp_path / "models")
    registry = FleetRegistry()
    registry.on_status(status("big", 10_000))
    link = FakeLink(registry, {})
    config = CoordinatorConfig(state_dir=str(tmp_path), deployment=DeploymentConfig(wait_s=60))
    courier = ModelCourier(config, link, Topics("lab"), registry, LOG, reads_reports=lambda: False)  # type: ignore[arg-type]
    outcome = courier.deliver(manifest)  # at once: no agent would say what it holds
    assert outcome["big"].startswith(f"sent {held_text(manifest.model('b'))}; not confirmed") and link.topics
    assert holds(held_text(manifest.model("b"))) and not holds(outcome["big"])
    assert not holds(f"did not say it holds {held_text(manifest.model('b'))} within 1 s")


def test_a_failure_to_write_the_models_does_not_fail_the_federation(tmp_path: Path) -> None:
    config = CoordinatorConfig(state_dir=str(tmp_path))
    courier = ModelCourier(config, object(), Topics("lab"), FleetRegistry(), LOG)  # type: ignore[arg-type]

    class Broken:
        def eval_targets(self) -> dict:
            raise RuntimeError("the exporter broke")

    assert courier.finish(Broken(), None, None, None, {}, None, None, 3) == {}  # type: ignore[arg-type]


def test_a_refusal_is_heard_and_not_waited_out(tmp_path: Path) -> None:
    manifest = models(tmp_path / "models")
    registry = FleetRegistry()
    registry.on_status(status("short", 10_000))
    link = FakeLink(registry, {"short": ModelStore(tmp_path / "short", LOG)}, available=100)  # less than it said
    config = CoordinatorConfig(state_dir=str(tmp_path), deployment=DeploymentConfig(wait_s=3600))
    outcome = ModelCourier(config, link, Topics("lab"), registry, LOG).deliver(manifest)  # type: ignore[arg-type]
    assert outcome["short"].startswith(f"refused {held_text(manifest.model('b'))}: model 'b' needs")
    assert not holds(outcome["short"])
