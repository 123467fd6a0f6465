"""coordinator.serving: the start-of-run statement of who a method serves, on a hand-built fleet (HeteroFL's
levels cost 1000, 500, 250, 125 and 62 bytes: conftest.width_cost), and the coordinator's per-device log."""

from __future__ import annotations

from coordinator.config import CoordinatorConfig, FedAvgConfig, ModelConfig
from coordinator.serving import (
    ServiceLog,
    answer_text,
    bytes_text,
    largest_needs,
    serve_tiers,
    service_lines,
    unserved_text,
)
from coordinator.strategies import make_strategy

FLEET = [("weak", 50, 2), ("medium", 300, 3), ("strong", 1000, 1)]  # (tier, budget bytes, devices)


def config(**overrides: object) -> CoordinatorConfig:
    cfg = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}), rounds=4)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_each_tier_gets_the_largest_level_that_fits_and_a_tier_below_the_smallest_is_named(make_context):
    strategy = make_strategy("heterofl", make_context(config()))
    services = serve_tiers(strategy, FLEET)
    assert [(s.tier, s.answer["trains"], s.served) for s in services] == [
        ("weak", "nothing", False), ("medium", "c", True), ("strong", "a", True)]
    weak = services[0]
    assert weak.answer["needs_bytes"] == 62  # level e, the smallest
    assert "levels" in weak.answer["to_fit"] and "0.0625" in weak.answer["to_fit"]
    lines = service_lines("heterofl", services)
    assert lines[0].startswith("heterofl serves 4 of 6 devices: ")
    assert "medium (0.3 KiB) -> c (width=1/4)" in lines[0]
    assert lines[1:] == [f"heterofl: {unserved_text(weak)}"]
    assert "tier weak (2 devices, 0.0 KiB) can train nothing: the smallest needs 0.1 KiB; to serve it: " \
           "a smaller last width in levels" in lines[1]


def test_a_fleet_served_whole_names_no_tier(make_context):
    strategy = make_strategy("heterofl", make_context(config()))
    lines = service_lines("heterofl", serve_tiers(strategy, [("any", 62, 4)]))
    assert lines == ["heterofl serves 4 of 4 devices: any (0.1 KiB) -> e (width=1/16)"]


def test_fedavg_says_its_one_model_does_not_fit(make_context):
    strategy = make_strategy("fedavg", make_context(config(fedavg=FedAvgConfig(width=0.5))))
    small, large = serve_tiers(strategy, [("small", 499, 1), ("large", 500, 1)])
    assert not small.served and small.answer["needs_bytes"] == 500 and "fedavg.width" in small.answer["to_fit"]
    assert large.served and answer_text(large.answer) == "a (width=1/2)"


def test_the_coordinator_tells_each_device_once_and_again_when_its_budget_crosses_the_smallest_need(
        make_context, make_agent):
    log = ServiceLog(make_strategy("heterofl", make_context(config())))
    first = log.changes([make_agent("x", 1000), make_agent("y", 50), make_agent("z", None, available=61)])
    assert [(agent, service.served) for agent, service in first] == [("x", True), ("y", False), ("z", False)]
    assert log.changes([make_agent("x", 600), make_agent("y", 40)]) == []  # nothing new to say
    again = log.changes([make_agent("x", 61), make_agent("y", 62)])
    assert [(agent, service.served) for agent, service in again] == [("x", False), ("y", True)]


def test_the_statement_says_when_no_tier_trains_the_largest_model(make_context):
    strategy = make_strategy("heterofl", make_context(config()))
    services = serve_tiers(strategy, [("weak", 300, 2), ("medium", 600, 2)])
    assert service_lines("heterofl", services, strategy.largest_whole_model())[-1] == (
        "heterofl: no tier trains its largest model (a): the parts only it holds learn from no device")
    served = serve_tiers(strategy, [("strong", 1000, 1)])
    assert not any("largest" in line for line in service_lines("heterofl", served, strategy.largest_whole_model()))
    needs = largest_needs(strategy)
    assert needs is not None and needs > 600
    assert service_lines("heterofl", services, strategy.largest_whole_model(), needs)[-1] == (
        f"heterofl: no tier trains its largest model (a, which needs {bytes_text(needs)} to train; the strongest "
        f"tier, medium, has {bytes_text(600)}): the parts only it holds learn from no device")


def test_the_brief_names_the_largest_task_a_method_hands_out(make_context):
    from coordinator.brief import MethodBrief

    for method in ("heterofl", "fedavg"):
        cfg = config(algorithm=method)
        strategy = make_strategy(method, make_context(cfg))
        brief = MethodBrief(cfg, strategy, strategy.family, (8, 8))
        # what an unbounded budget is handed: the largest level (1000 bytes for the full width), no smaller one
        assert brief.largest_task_bytes() == largest_needs(strategy) == 1000
    cfg = config(algorithm="fedavg", fedavg=FedAvgConfig(width=0.25))
    strategy = make_strategy("fedavg", make_context(cfg))
    assert MethodBrief(cfg, strategy, strategy.family, (8, 8)).largest_task_bytes() == 250
