"""End to end under secure aggregation, over a real mosquitto (secured): the devices advertise keys, share, upload
masked updates and give back shares through the MQTT link, and the coordinator's model is the one plain uniform
aggregation makes of the same updates, with and without a device dropping out after it shared."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.data import load_dataset
from coordinator.checkpoint import load_checkpoint
from coordinator.daemon import Coordinator
from coordinator.secure.settings import SecureAggregationConfig
from fedfit.sim.harness import SimOptions, run_simulation

from .conftest import SecuredBroker, digits_fleet, on_broker, tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

SECURE = SecureAggregationConfig(enabled=True, phase_s=30.0)


def test_a_secure_round_makes_the_model_plain_uniform_aggregation_makes(mosquitto_installed: None,
                                                                        tmp_path: Path) -> None:
    states = {}
    for name, secure in (("plain", SecureAggregationConfig()), ("secure", SECURE)):
        options = SimOptions(algorithm="heterofl", agents=3, rounds=1, dataset="digits", seed=1, federation=f"sa-{name}",
                             base=tiny_config(secure_aggregation=secure), budgets="widths:1,1,1",
                             state_dir=str(tmp_path / name))
        report = run_simulation(options, progress=None).report
        assert {task["status"] for task in report["tasks"]} == {"ok"}, report["tasks"]
        states[name] = load_checkpoint(tmp_path / name / "checkpoint.safetensors")[0]["global"]
        if secure.enabled:
            exchange = report["rounds"][0]["secure"]
            assert (exchange["advertised"], exchange["shared"], exchange["sent"], exchange["revealed"],
                    exchange["failure"]) == (3, 3, 3, 3, None), exchange
        else:
            assert "secure" not in report["rounds"][0]
    # The same training (the same seed, one thread each): the fixed point's sum against float32's, nothing more.
    for key, value in states["plain"].items():
        if value.is_floating_point():
            torch.testing.assert_close(states["secure"][key], value, rtol=2e-6, atol=1e-6, msg=key)


def test_a_device_gone_after_sharing_is_unmasked_away(secured_mosquitto: SecuredBroker, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = load_dataset("digits")
    broker = secured_mosquitto("sa-drop")
    names = ("dev-a", "dev-b", "dev-c", "quitter")
    config = on_broker(tiny_config(federation="sa-drop", rounds=1, min_agents=len(names), state_dir=str(tmp_path),
                                   algorithm="fedavg", secure_aggregation=SECURE), broker)
    coordinator = Coordinator(config, dataset=dataset)
    before = {key: value.clone() for key, value in coordinator.states["global"].items()}
    agents = digits_fleet(dataset, names, config, broker)
    clear: dict[str, dict[str, np.ndarray]] = {}
    for agent in agents:
        original = agent.secure._mask

        def mask(held, relay, agent=agent, original=original) -> None:
            if agent.agent_id == "quitter":  # its process is gone once it shared: it never masks nor sends
                raise ValueError("the device stopped after sharing")
            clear[agent.agent_id] = {key: np.array(value) for key, value in held.update.weights.items()}
            original(held, relay)
        monkeypatch.setattr(agent.secure, "_mask", mask)
    try:
        coordinator.start()
        for agent in agents:
            agent.start()
        [result] = coordinator.run()
    finally:
        for agent in agents:
            agent.stop()
        coordinator.stop()
    assert result.secure is not None
    assert (result.secure["shared"], result.secure["sent"], result.secure["failure"]) == (4, 3, None), result.secure
    statuses = {task.agent: (task.status, task.reason) for task in result.tasks}
    assert statuses["quitter"][0] == "failed" and "the device stopped after sharing" in (statuses["quitter"][1] or "")
    assert sorted(clear) == ["dev-a", "dev-b", "dev-c"]
    after = coordinator.states["global"]
    for key, value in before.items():  # each weight the mean of the three that sent (BN statistics: recomputed)
        if not value.is_floating_point() or "running" in key:
            continue
        expected = torch.from_numpy(np.mean([clear[name][key] for name in clear], axis=0, dtype=np.float64))
        torch.testing.assert_close(after[key].double(), expected, rtol=1e-6, atol=1e-6, msg=key)
        assert not torch.equal(after[key], value), key
