"""Coordinator logic that needs no broker: resume from a checkpoint, validation of incoming updates against what
was sent (nesting, exits, tensors), collection, evaluation of every exit, and one whole round with the transport
replaced by hand-made updates."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from common.data import load_dataset
from coordinator import reporting
from coordinator.checkpoint import load_checkpoint, save_checkpoint
from coordinator.config import (
    CoordinatorConfig,
    DataConfig,
    DeploymentConfig,
    ModelConfig,
    RecipeConfig,
    ScaleFLConfig,
    ScreeningConfig,
)
from coordinator.daemon import REGISTRY_SETTLE_S, Coordinator, NoAgentsError, Progress
from coordinator.metrics import RoundResult
from coordinator.registry import AgentRecord
from coordinator.round import DispatchedTask, Receipt
from coordinator.strategies import TaskPlan, TaskResult
from models import SubmodelSpec
from protocol import Ack, Adaptation, AgentStatus, Capabilities, Update, decode


def offer(coordinator: Coordinator, update: Update, size: int = 10) -> Receipt:
    """Hand an update to the round in progress as if it had arrived (stored nowhere)."""
    assert coordinator.in_flight.current() is not None
    return coordinator.in_flight.current().receive(update, bytes(size), "", stored=True)


def open_round(coordinator: Coordinator, round_number: int, tasks: dict[str, TaskPlan]) -> None:
    """Make a round of ``tasks`` the one in progress, collecting."""
    coordinator.in_flight.install(coordinator.planner.new_round(round_number, tasks, [], time.time() + 60))


def config(tmp_path: Path, **overrides: object) -> CoordinatorConfig:
    # Hand-made updates are far from anything a plan could train: screening (tests/coordinator/test_screening.py
    # and the integration tests) is off here.
    cfg = CoordinatorConfig(model=ModelConfig(family="cnn", options={"hidden": [4, 8]}),
                            data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50),
                            recipe=RecipeConfig(batch_size=8), levels=[1.0, 0.5], state_dir=str(tmp_path),
                            screening=ScreeningConfig(enabled=False), deployment=DeploymentConfig(deliver=False))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def scalefl_config(tmp_path: Path, **overrides: object) -> CoordinatorConfig:
    """ScaleFL on a four-block CNN (digits are 8x8): levels 1..3 with early exits, FLOPs as the split cost."""
    return config(tmp_path, algorithm="scalefl", model=ModelConfig(family="cnn", options={"hidden": [4, 8, 16, 32]}),
                  scalefl=ScaleFLConfig(ratios=[0.25, 0.5, 1.0], cost="flops", grid_step=0.05), **overrides)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture
def heterofl(tmp_path: Path, digits) -> Coordinator:
    return Coordinator(config(tmp_path), dataset=digits)


@pytest.fixture
def scalefl(tmp_path: Path, digits) -> Coordinator:
    return Coordinator(scalefl_config(tmp_path), dataset=digits)


def update_for(coordinator: Coordinator, spec: SubmodelSpec | None, *, labels: list[int] = (0, 1),
               fill: float = 1.0, drop: str | None = None, extra: dict | None = None, status: str = "ok",
               task_id: str = "t-1", agent: str = "dev", round_number: int = 1,
               shapes_of: SubmodelSpec | None = None) -> Update:
    """An update carrying ``spec`` (None: no spec_trained) with every trainable tensor set to ``fill``."""
    family = coordinator.family
    of = shapes_of or spec or SubmodelSpec.full()
    shapes = family.shapes(of, track_bn_stats=False)
    weights = {k: np.full(shapes[k], fill, dtype=np.float32) for k in family.trainable_keys(of) if k != drop}
    weights.update(extra or {})
    return Update(task_id, round_number, agent, status, None if spec is None else spec.to_dict(), 10,
                  list(labels), weights, {"loss": 0.5}, None)


def task_for(coordinator: Coordinator, level_name: str, agent: str = "dev", round_number: int = 1) -> TaskPlan:
    strategy = coordinator.strategy
    level = next(level for level in strategy.levels if level.name == level_name)
    return TaskPlan(agent, level.name, level.spec, strategy.level_plan(level, round_number), strategy.group_of(level),
                    strategy.ladder(level, round_number))


def level_spec(coordinator: Coordinator, name: str) -> SubmodelSpec:
    return next(level.spec for level in coordinator.strategy.levels if level.name == name)


# ---------------------------------------------------------------------------------------------- resume
def test_resume_continues_from_the_checkpoint(tmp_path: Path, digits) -> None:
    first = Coordinator(config(tmp_path), dataset=digits)
    marked = {k: v.clone() for k, v in first.states["global"].items()}
    marked["classifier.bias"] = torch.full_like(marked["classifier.bias"], 7.0)
    save_checkpoint(first.files.checkpoint_path, {"global": marked},
                    {"round": 3, "algorithm": "heterofl", "family": "cnn", "strategy": {}})
    resumed = Coordinator(config(tmp_path, resume=True), dataset=digits)
    assert resumed.completed_rounds == 3
    torch.testing.assert_close(resumed.states["global"]["classifier.bias"], marked["classifier.bias"])
    # Without resume, a state_dir holding a run is refused: its checkpoint is not overwritten.
    with pytest.raises(ValueError, match="holds an earlier run .checkpoint.safetensors.: set resume: true to continue"):
        Coordinator(config(tmp_path, resume=False), dataset=digits)
    assert load_checkpoint(first.files.checkpoint_path)[1]["round"] == 3
    assert Coordinator(config(tmp_path / "other", resume=False), dataset=digits).completed_rounds == 0


def test_resume_refuses_a_checkpoint_of_another_algorithm(tmp_path: Path, digits) -> None:
    first = Coordinator(config(tmp_path), dataset=digits)
    save_checkpoint(first.files.checkpoint_path, first.states, {"round": 1, "algorithm": "fedavg", "family": "cnn"})
    with pytest.raises(ValueError, match="fedavg"):
        Coordinator(config(tmp_path, resume=True), dataset=digits)


def test_resume_refuses_other_groups_other_tensors_and_foreign_strategy_state(tmp_path: Path, digits) -> None:
    first = Coordinator(config(tmp_path), dataset=digits)
    meta = {"round": 1, "algorithm": "heterofl", "family": "cnn"}
    copy = {k: v.clone() for k, v in first.states["global"].items()}
    save_checkpoint(first.files.checkpoint_path, {"a": first.states["global"], "b": copy}, meta)
    with pytest.raises(ValueError, match=r"model groups \['a', 'b'\]"):
        Coordinator(config(tmp_path, resume=True), dataset=digits)
    fewer = {k: v for k, v in first.states["global"].items() if k != "conv1.bias"}
    save_checkpoint(first.files.checkpoint_path, {"global": fewer}, meta)
    with pytest.raises(ValueError, match="does not match this model"):
        Coordinator(config(tmp_path, resume=True), dataset=digits)
    save_checkpoint(first.files.checkpoint_path, first.states, {**meta, "strategy": {"scores": [1]}})
    with pytest.raises(ValueError, match="keeps no state"):
        Coordinator(config(tmp_path, resume=True), dataset=digits)


def test_unknown_algorithm_is_refused_when_the_strategy_is_made(tmp_path: Path, digits) -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'fedprox'"):
        Coordinator(config(tmp_path, algorithm="fedprox"), dataset=digits)


# ---------------------------------------------------------------------------------------------- updates
def test_nested_update_is_accepted(heterofl: Coordinator) -> None:
    half = SubmodelSpec.uniform(0.5)
    task = task_for(heterofl, "b")
    assert task.spec == half
    result = heterofl.intake.unpack(update_for(heterofl, half, labels=[0, 1, 42], fill=2.0), task)
    assert isinstance(result, TaskResult)
    assert result.task is task and result.spec == half
    assert set(result.state) == set(result.index_map) == set(heterofl.family.trainable_keys(half))
    full_map = heterofl.family.index_map(half)
    for key, tensor in result.state.items():
        assert tensor.dtype == torch.float32 and torch.all(tensor == 2.0)
        assert tuple(tensor.shape) == tuple(len(idx) for idx in full_map[key])
    assert result.num_samples == 10
    assert result.labels == [0, 1]  # labels the dataset does not have are dropped


def test_update_without_a_trained_spec_is_taken_as_the_sent_spec(heterofl: Coordinator) -> None:
    task = task_for(heterofl, "b")
    result = heterofl.intake.unpack(update_for(heterofl, None, shapes_of=task.spec), task)
    assert result.spec == task.spec


def test_wider_update_than_sent_is_rejected(heterofl: Coordinator) -> None:
    with pytest.raises(ValueError, match=r"agent trained width=1, which is not inside the width=0\.5 sent"):
        heterofl.intake.unpack(update_for(heterofl, SubmodelSpec.full()), task_for(heterofl, "b"))


def test_update_with_an_extra_exit_is_rejected(heterofl: Coordinator, scalefl: Coordinator) -> None:
    with_exit = SubmodelSpec(width=0.5, exits=(0,))
    with pytest.raises(ValueError, match="not inside"):
        heterofl.intake.unpack(update_for(heterofl, with_exit), task_for(heterofl, "b"))
    lowest = level_spec(scalefl, "1")
    assert lowest.depth is not None and lowest.depth >= 2
    extra = SubmodelSpec(width=lowest.width, rounding="floor", depth=lowest.depth,
                         exits=tuple(sorted({0, *lowest.exits})))
    assert extra != lowest
    with pytest.raises(ValueError, match="not inside"):
        scalefl.intake.unpack(update_for(scalefl, extra), task_for(scalefl, "1"))


def test_update_deeper_than_sent_is_rejected(scalefl: Coordinator) -> None:
    lowest = level_spec(scalefl, "1")
    deeper = SubmodelSpec(width=lowest.width, rounding="floor", exits=lowest.exits)  # every block, final head
    with pytest.raises(ValueError, match="not inside"):
        scalefl.intake.unpack(update_for(scalefl, deeper), task_for(scalefl, "1"))


def test_update_with_missing_or_extra_tensors_is_rejected(heterofl: Coordinator, scalefl: Coordinator) -> None:
    half, task = SubmodelSpec.uniform(0.5), task_for(heterofl, "b")
    with pytest.raises(ValueError, match=r"missing \['conv1\.bias'\], unexpected \[\]"):
        heterofl.intake.unpack(update_for(heterofl, half, drop="conv1.bias"), task)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['bogus\.weight'\]"):
        heterofl.intake.unpack(update_for(heterofl, half, extra={"bogus.weight": np.zeros(2, np.float32)}), task)
    # BN statistics are not trained: an update must not carry them.
    with pytest.raises(ValueError, match=r"unexpected \['bn1\.running_mean'\]"):
        heterofl.intake.unpack(update_for(heterofl, half, extra={"bn1.running_mean": np.zeros(2, np.float32)}),
                                task)
    # A cut level has no final classifier.
    lowest = level_spec(scalefl, "1")
    with pytest.raises(ValueError, match=r"unexpected \['classifier\.weight'\]"):
        scalefl.intake.unpack(update_for(scalefl, lowest, extra={"classifier.weight": np.zeros((10, 32), np.float32)}),
                               task_for(scalefl, "1"))


def test_update_with_a_wrong_shape_is_rejected(heterofl: Coordinator) -> None:
    half = SubmodelSpec.uniform(0.5)
    with pytest.raises(ValueError, match=r"tensor 'conv1\.bias' has shape \(4,\), expected \(2,\)"):
        heterofl.intake.unpack(update_for(heterofl, half, extra={"conv1.bias": np.zeros(4, np.float32)}),
                                task_for(heterofl, "b"))


def test_update_with_a_spec_the_family_cannot_build_is_rejected(heterofl: Coordinator) -> None:
    bad = update_for(heterofl, SubmodelSpec.uniform(0.5))
    bad.spec_trained = {"width": 0.5, "exits": [5]}
    with pytest.raises(ValueError, match="no exit point after block 5"):
        heterofl.intake.unpack(bad, task_for(heterofl, "b"))
    bad.spec_trained = {"width": 0.5, "colour": "red"}
    with pytest.raises(ValueError, match="unknown sub-model spec key 'colour'"):
        heterofl.intake.unpack(bad, task_for(heterofl, "b"))


def test_nested_adapted_update_is_accepted(scalefl: Coordinator) -> None:
    top, middle = task_for(scalefl, "3"), level_spec(scalefl, "2")
    assert scalefl.family.is_nested(middle, top.spec) and middle != top.spec
    assert middle.to_dict() in [c.spec for c in top.adaptation.candidates]
    result = scalefl.intake.unpack(update_for(scalefl, middle, status="adapted"), top)
    assert result.spec == middle and result.task is top
    assert set(result.state) == set(scalefl.family.trainable_keys(middle))
    exit_keys = [k for k in result.state if k.startswith("exits.")]
    assert exit_keys and all(k.split(".")[1] in {str(b) for b in middle.exits} for k in exit_keys)


def test_masked_cross_entropy_keeps_absent_class_rows(tmp_path: Path, digits) -> None:
    cfg = config(tmp_path)
    cfg.recipe.masked_ce = True
    coordinator = Coordinator(cfg, dataset=digits)
    task = task_for(coordinator, "a")
    assert task.plan.uses_masked_ce
    result = coordinator.intake.unpack(update_for(coordinator, SubmodelSpec.full(), labels=[2, 5]), task)
    assert result.labels == [2, 5]
    before = coordinator.states["global"]
    merged = coordinator.strategy.aggregate(1, [result], coordinator.states)["global"]
    for row in range(10):
        if row in (2, 5):
            assert torch.all(merged["classifier.weight"][row] == 1.0)
        else:
            torch.testing.assert_close(merged["classifier.weight"][row], before["classifier.weight"][row])


# ---------------------------------------------------------------------------------------------- collection
def test_a_rounds_answers_become_records_outcomes_and_an_aggregate(scalefl: Coordinator) -> None:
    names = {"ok": "3", "adapted": "3", "wide": "1", "declined": "2", "failed": "1", "silent": "1"}
    open_round(scalefl, 1, {f"t-{agent}": task_for(scalefl, level, agent) for agent, level in names.items()})
    spec = {name: level_spec(scalefl, name) for name in ("1", "2", "3")}
    offers = [
        update_for(scalefl, spec["3"], task_id="t-ok", agent="ok"),
        update_for(scalefl, spec["2"], task_id="t-adapted", agent="adapted", status="adapted"),
        update_for(scalefl, spec["3"], task_id="t-wide", agent="wide", status="adapted"),
        Update("t-declined", 1, "declined", "declined", None, 0, [], {}, {"budget_bytes": 5.0}, "too small"),
        Update("t-failed", 1, "failed", "failed", None, 0, [], {}, {}, "killed"),
    ]
    for update in offers:
        assert offer(scalefl, update, 100).verdict == "accepted"
    current = scalefl.in_flight.current()
    assert current is not None
    current.close()
    current.finish()
    records, outcomes = reporting.outcomes(current, scalefl.family, scalefl.log)
    verdicts = {a.update.agent_id: a.rejection for a in current.answers.values() if a.screened}
    assert verdicts == {"adapted": None, "ok": None}  # screening is off here: both aggregated
    assert [(a.update.agent_id, a.spec) for a in current.aggregated()] == [("adapted", spec["2"]), ("ok", spec["3"])]
    by_agent = {o.task.agent_id: o for o in outcomes}
    assert set(by_agent) == {"ok", "adapted", "wide", "declined", "failed", "silent"}
    assert by_agent["silent"].status == "missing" and records["silent"].reason == "no update by deadline"
    assert {a: o.status for a, o in by_agent.items()} == {
        "ok": "ok", "adapted": "adapted", "wide": "rejected", "declined": "declined", "failed": "failed",
        "silent": "missing"}
    assert by_agent["adapted"].spec_trained == spec["2"] and by_agent["wide"].spec_trained is None
    assert by_agent["declined"].metrics == {"budget_bytes": 5.0}
    assert records["wide"].status == "rejected" and "not inside" in records["wide"].reason
    assert records["wide"].spec_sent == spec["1"].describe()
    assert records["wide"].spec_trained == spec["3"].describe()
    assert records["adapted"].spec_trained == spec["2"].describe() and records["adapted"].level == "3"
    assert records["adapted"].level_trained == "2" and records["ok"].level_trained == "3"
    assert records["wide"].level_trained is None  # rejected: nothing was trained as a level
    assert records["declined"].reason == "too small" and records["failed"].reason == "killed"
    assert records["ok"].num_samples == 10 and records["ok"].metrics == {"loss": 0.5}


# ---------------------------------------------------------------------------------------------- evaluation
def test_evaluate_reports_every_exit_of_the_global_model(scalefl: Coordinator) -> None:
    strategy = scalefl.strategy
    global_spec = strategy.global_spec()
    before = {k: v.clone() for k, v in scalefl.states["global"].items()}
    results = reporting.evaluate_targets(scalefl._evaluator, strategy.eval_targets(), scalefl.states)
    assert set(results) == set(strategy.eval_targets()) == {"1", "2", "3", "global"}
    assert len(results["global"]) == len(global_spec.exits) + 1 >= 3
    for name, target in strategy.eval_targets().items():
        accs = results[name]
        assert len(accs) == scalefl.family.build(target.spec).num_outputs
        assert all(0.0 <= acc <= 1.0 for acc in accs)
    assert results["3"] == results["global"]  # the top level is the global model
    # The global model's recomputed BN statistics are kept in its state.
    assert not torch.equal(scalefl.states["global"]["bn1.running_mean"], before["bn1.running_mean"])
    expected, _ = scalefl._evaluator.evaluate(before, global_spec)
    assert results["global"] == pytest.approx(expected)


def test_evaluate_without_exits_reports_one_accuracy_per_target(heterofl: Coordinator) -> None:
    before = {k: v.clone() for k, v in heterofl.states["global"].items()}
    results = reporting.evaluate_targets(heterofl._evaluator, heterofl.strategy.eval_targets(), heterofl.states)
    assert set(results) == {"global", "a", "b"}
    assert all(len(accs) == 1 for accs in results.values())
    expected, bn_state = heterofl._evaluator.evaluate(before, SubmodelSpec.full())
    assert results["global"] == results["a"] == pytest.approx(expected)
    # The global target stores its BN statistics, even though level a (the same model) is evaluated first.
    for key in ("bn1.running_mean", "bn2.running_var"):
        torch.testing.assert_close(heterofl.states["global"][key], bn_state[key], msg=key)
        assert not torch.equal(bn_state[key], before[key])


# ---------------------------------------------------------------------------------------------- a whole round
def agent_record(agent_id: str) -> AgentRecord:
    capabilities = Capabilities("generic", 10**12, 10**12, None, 10, list(range(10)))
    return AgentRecord(agent_id, "online", capabilities, 0.0)


def test_run_round_with_early_exits_reports_exit_accuracies(tmp_path: Path, digits, monkeypatch) -> None:
    cfg = scalefl_config(tmp_path, rounds=2)
    cfg.level_assignment = "dynamic"
    coordinator = Coordinator(cfg, dataset=digits)
    agents = [agent_record(f"sim-{i}") for i in range(4)]
    monkeypatch.setattr(coordinator.registry, "wait_settled", lambda count, quiet, timeout, on_change=None: agents)
    sent: list[TaskPlan] = []

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        sent.append(planned)
        status = "failed" if planned.agent_id == "sim-3" else "ok"
        update = update_for(coordinator, planned.spec, task_id=task_id, agent=planned.agent_id, status=status,
                            round_number=round_number, fill=0.5)
        assert offer(coordinator, update, 1000).verdict == "accepted"
        return 10

    monkeypatch.setattr(coordinator.dispatcher, "send", dispatch)
    published: list[tuple[str, bytes]] = []
    monkeypatch.setattr(coordinator.link, "publish", lambda topic, payload, **_: published.append((topic, payload)))
    seen: list[RoundResult] = []
    progress: list[Progress] = []
    coordinator.on_round = seen.append
    coordinator.on_progress = progress.append
    result = coordinator.run_round(1)
    assert seen == [result]
    assert progress == [Progress("round", 1, 4, 4)]  # every update was in when the dispatch ended
    assert len(sent) == 4 and result.selected == 4 and result.participants == 3
    assert (result.bytes_down, result.bytes_up) == (40, 4000)
    outputs = len(coordinator.strategy.global_spec().exits) + 1
    assert list(result.exit_accuracy) == [f"exit{i}" for i in range(1, outputs + 1)]
    assert result.global_accuracy == result.exit_accuracy[f"exit{outputs}"]
    assert set(result.level_accuracy) == {"1", "2", "3"}
    assert result.level_accuracy["3"] == result.global_accuracy
    assert [(t.agent, t.status) for t in result.tasks] == [
        ("sim-0", "ok"), ("sim-1", "ok"), ("sim-2", "ok"), ("sim-3", "failed")]
    # The levels some update trained as such, and the outputs whose heads an update reached.
    trained = sorted({planned.level for planned in sent if planned.agent_id != "sim-3"})
    assert result.trained_levels == trained
    assert "exit1" in result.trained_exits  # every level holds the first exit
    assert (f"exit{outputs}" in result.trained_exits) is ("3" in trained)  # the final head: the top level's
    # The headline: the largest level trained (the global model when that is the top level), never an untrained head.
    largest = max(trained, key=lambda name: coordinator.family.param_count(level_spec(coordinator, name)))
    assert result.deployed == ("global" if largest == "3" else largest)
    assert result.headline == (result.global_accuracy if largest == "3" else result.level_accuracy[largest])
    assert coordinator.files.trained_so_far.levels == set(trained)
    # After screening, each device whose update was stored hears the verdict (a failed task is not aggregated).
    verdicts = [decode(payload, expected=Ack) for topic, payload in published if topic.endswith("/ack")]
    assert sorted((ack.agent_id, ack.verdict, ack.reason) for ack in verdicts) == [
        ("sim-0", "aggregated", None), ("sim-1", "aggregated", None), ("sim-2", "aggregated", None)]
    # Aggregated: the first conv's leading channel (held by every level) is the updates' 0.5.
    assert torch.all(coordinator.states["global"]["conv1.weight"][0] == 0.5)
    states, meta = load_checkpoint(coordinator.files.checkpoint_path)
    assert meta["round"] == 1 and meta["algorithm"] == "scalefl" and meta["strategy"] == {}
    torch.testing.assert_close(states["global"]["conv1.weight"], coordinator.states["global"]["conv1.weight"])
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["exit_accuracy"] == result.exit_accuracy and row["round"] == 1


def round_trained_as(coordinator: Coordinator, spec: SubmodelSpec, agents: list[str], monkeypatch) -> RoundResult:
    """Round 1 of ``agents``, each of which answers its task with an update of ``spec``."""
    monkeypatch.setattr(coordinator.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: [agent_record(agent) for agent in agents])

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        offer(coordinator, update_for(coordinator, spec, task_id=task_id, agent=planned.agent_id,
                                      round_number=round_number, fill=0.1))
        return 10

    monkeypatch.setattr(coordinator.dispatcher, "send", dispatch)
    return coordinator.run_round(1)


def test_the_headline_is_the_largest_level_trained_when_no_device_trains_the_global_model(
        heterofl: Coordinator, monkeypatch) -> None:
    """Every device trains level b (narrower than it was sent): the round's headline is level b's accuracy, named,
    with the untrained global model's beside it."""
    result = round_trained_as(heterofl, level_spec(heterofl, "b"), ["sim-0", "sim-1"], monkeypatch)
    assert result.trained_levels == ["b"] and result.deployed == "b"
    assert result.headline == result.deployed_accuracy == result.level_accuracy["b"]
    assert result.global_accuracy == result.level_accuracy["a"]  # the global model: kept beside it


def test_depthfls_ensemble_is_of_the_classifiers_trained_so_far(tmp_path: Path, digits, monkeypatch) -> None:
    """Only the first level trains: the headline is the ensemble of its classifier alone, not of every head."""
    coordinator = Coordinator(config(tmp_path, algorithm="depthfl", model=ModelConfig(
        family="cnn", options={"hidden": [4, 8, 8]})), dataset=digits)
    assert coordinator.model_ref.options["exit_convs"] == coordinator.family.options["exit_convs"] == 0  # its heads
    result = round_trained_as(coordinator, level_spec(coordinator, "1"), ["sim-0"], monkeypatch)
    assert result.trained_exits == ["exit1"] and result.deployed == "ensemble"
    global_spec = coordinator.strategy.global_spec()
    alone = coordinator._evaluator.evaluate(coordinator.states["global"], global_spec, ensemble=True, members=[0])
    assert result.headline == pytest.approx(alone[0][-1])


def test_run_round_without_exits_reports_no_exit_accuracies(heterofl: Coordinator, monkeypatch) -> None:
    monkeypatch.setattr(heterofl.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: [agent_record("sim-0")])

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        offer(heterofl, Update(task_id, round_number, planned.agent_id, "declined", None, 0, [], {}, {},
                                         "no memory"))
        return 10

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    result = heterofl.run_round(1)
    assert result.exit_accuracy == {} and result.participants == 0
    assert set(result.level_accuracy) == {"a", "b"}
    assert [(t.status, t.reason) for t in result.tasks] == [("declined", "no memory")]


def test_an_update_sent_again_after_its_round_closed_hears_the_verdict_it_got(heterofl: Coordinator,
                                                                              monkeypatch) -> None:
    """A device killed before it heard its ack sends its update again (or asks to) once the round is over: it is
    answered with the verdict that round gave it, not told its task is unknown; another update for that task (or a
    request with another digest) is refused as before."""
    import hashlib

    from protocol import Topics, UploadRequest, encode, split_payload

    topics = Topics(heterofl.config.federation)
    monkeypatch.setattr(heterofl.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: [agent_record("sim-0")])
    sent: list[object] = []
    monkeypatch.setattr(heterofl.link, "publish", lambda topic, payload, **_: (
        None if topic == topics.coordinator_status() else sent.append(decode(payload))))
    updates: list[Update] = []

    def send(update: Update, transfer: str) -> None:
        for chunk in split_payload(encode(update), transfer):
            heterofl._on_message(topics.agent_update(update.agent_id), chunk)

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        updates.append(update_for(heterofl, planned.spec, task_id=task_id, agent=planned.agent_id,
                                  round_number=round_number, fill=0.1))
        send(updates[-1], f"{task_id}.1")
        return 10

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    assert heterofl.run_round(1).participants == 1
    update = updates[0]
    first, verdict = Ack(update.task_id, 1, "sim-0"), Ack(update.task_id, 1, "sim-0", None, "aggregated")
    assert sent == [first, verdict]
    send(update, f"{update.task_id}.2")  # the whole update again
    assert sent[-1] == verdict
    digest = hashlib.sha256(encode(update)).hexdigest()
    for asked in ("", digest):  # asked to send it again (a request without its digest: taken as the same update)
        del sent[:]
        heterofl._on_message(topics.agent_update("sim-0"),
                             encode(UploadRequest(update.task_id, 1, "sim-0", 10, asked)))
        assert sent == [verdict]  # answered, not granted
    heterofl._on_message(topics.agent_update("sim-0"), encode(UploadRequest(update.task_id, 1, "sim-0", 10, "0" * 64)))
    assert isinstance(sent[-1], Ack) and sent[-1].verdict is None and "unknown task" in (sent[-1].reason or "")
    other = replace(update, weights={key: value + 1 for key, value in update.weights.items()})
    send(other, f"{update.task_id}.3")  # not the update the verdict judged
    assert isinstance(sent[-1], Ack) and sent[-1].verdict is None and "unknown task" in (sent[-1].reason or "")


def test_the_first_round_needs_min_agents_and_says_so_when_they_do_not_come(heterofl: Coordinator,
                                                                           monkeypatch) -> None:
    heterofl.config.min_agents, heterofl.config.wait_for_agents_s = 3, 0.2
    with pytest.raises(NoAgentsError, match=r"^no agent of federation '.*' came online within 0.2 s; start agents"):
        heterofl.run_round(1)
    heterofl.registry.on_status(AgentStatus("sim-0", "online", agent_record("sim-0").capabilities, 0.0))
    with pytest.raises(NoAgentsError, match=r"^1 of the 3 agents of federation '.*' that min_agents asks for came "
                                            r"online within 0.2 s; start more agents or lower min_agents$"):
        heterofl.run_round(1)


def test_the_first_round_waits_for_the_fleet_to_settle_later_rounds_do_not(heterofl: Coordinator,
                                                                           monkeypatch) -> None:
    calls: list[str] = []
    fleet = [agent_record("sim-0"), agent_record("sim-1")]
    monkeypatch.setattr(heterofl.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: calls.append(f"settled {count} {quiet}")
                        or fleet)
    monkeypatch.setattr(heterofl.registry, "wait_for", lambda count, timeout: calls.append("wait_for") or fleet)

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        offer(heterofl, Update(task_id, round_number, planned.agent_id, "declined", None, 0, [], {}, {},
                                         "no memory"))
        return 10

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    assert heterofl.run_round(1).selected == 2 and heterofl.run_round(2).selected == 2
    assert calls == [f"settled 1 {REGISTRY_SETTLE_S}", "wait_for"]


def test_an_update_is_acked_only_once_stored_and_otherwise_refused_with_the_reason(heterofl: Coordinator,
                                                                                 monkeypatch) -> None:
    from protocol import Ack, Topics, decode, encode, split_payload

    answers: list[Ack] = []
    monkeypatch.setattr(heterofl.link, "publish", lambda topic, payload, **_: answers.append(decode(payload)))
    task = task_for(heterofl, "b")
    spec = task.spec

    def send(update: Update) -> Ack:
        for chunk in split_payload(encode(update), f"{update.task_id}.{len(answers)}"):
            heterofl._on_message(Topics(heterofl.config.federation).agent_update("dev"), chunk)
        return answers[-1]

    good = update_for(heterofl, spec, task_id="r2-dev-1", agent="dev", status="ok", round_number=2, fill=0.1)
    assert send(good).reason == "unknown task 'r2-dev-1' of round 2: no round is in progress"
    open_round(heterofl, 2, {"r2-dev-1": task, "r2-dev-2": task})
    heterofl.files.journal.begin(2, time.time() + 60, {"r2-dev-1": task, "r2-dev-2": task}, [])
    stale = update_for(heterofl, spec, task_id="r1-dev-1", agent="dev", status="ok", round_number=1, fill=0.1)
    assert send(stale).reason == "unknown task 'r1-dev-1' of round 1: round 2 is in progress"
    assert send(good) == Ack("r2-dev-1", 2, "dev")  # stored: an ack without a reason
    assert [u.task_id for u, _ in heterofl.files.journal.stored({"r2-dev-1", "r2-dev-2"})] == ["r2-dev-1"]  # on disk before the ack
    assert send(good).reason is None  # sent again: stored already
    other = update_for(heterofl, spec, task_id="r2-dev-1", agent="dev", status="ok", round_number=2, fill=0.2)
    assert send(other).reason.startswith("another update for task 'r2-dev-1' arrived first and is the one kept")
    wide = update_for(heterofl, SubmodelSpec.full(), task_id="r2-dev-2", agent="dev", status="ok", round_number=2,
                      fill=0.1)
    assert send(wide).reason.startswith("update rejected: agent trained width=1, which is not inside the width=0.5")
    heterofl.in_flight.current().close()  # the round closes
    late = update_for(heterofl, spec, task_id="r2-dev-3", agent="dev", status="ok", round_number=2, fill=0.1)
    heterofl.in_flight.current().tasks["r2-dev-3"] = DispatchedTask("r2-dev-3", 2, task, time.time())
    assert send(late).reason == "round 2 closed before the update arrived"


def test_a_journaled_round_takes_resent_updates_before_it_runs(tmp_path: Path, digits, monkeypatch) -> None:
    """A coordinator restarted after a crash answers the updates its agents resend for the journaled round from
    its first message on, not only once run() gets to the round (they would be refused for good and lost)."""
    from protocol import Ack, Topics, decode, encode, split_payload

    crashed = Coordinator(config(tmp_path), dataset=digits)
    task = task_for(crashed, "b")
    crashed.files.journal.begin(1, time.time() + 60, {"r1-dev-1": task, "r1-dev-2": task}, [])
    restarted = Coordinator(config(tmp_path, resume=True), dataset=digits)
    answers: list[Ack] = []
    monkeypatch.setattr(restarted.link, "publish", lambda topic, payload, **_: answers.append(decode(payload)))
    update = update_for(restarted, task.spec, task_id="r1-dev-1", agent="dev", round_number=1, fill=0.1)
    for chunk in split_payload(encode(update), "r1-dev-1.1"):
        restarted._on_message(Topics(restarted.config.federation).agent_update("dev"), chunk)
    assert answers == [Ack("r1-dev-1", 1, "dev")]  # stored: acked without a reason
    assert [u.task_id for u, _ in restarted.files.journal.stored({"r1-dev-1", "r1-dev-2"})] == ["r1-dev-1"]
    sent: list[str] = []
    monkeypatch.setattr(restarted.dispatcher, "send", lambda round_number, task_id, *_: sent.append(task_id) or 0)
    restarted.in_flight.current().deadline = time.time() + 0.5
    # Its tasks go out once the agent's status is in (what it reads decides what it is sent).
    restarted.registry.on_status(AgentStatus("dev", "online", agent_record("dev").capabilities, time.time()))
    result = restarted.run_round(1)
    assert sent == ["r1-dev-2"]  # the answered task is not sent again
    assert result.participants == 1  # and the update taken before it ran was aggregated


def test_the_retained_status_carries_the_round_in_progress_then_the_last_completed(heterofl: Coordinator,
                                                                                   monkeypatch) -> None:
    from protocol import CoordinatorStatus, decode

    said: list[int] = []
    monkeypatch.setattr(heterofl.link, "publish", lambda topic, payload, **_: said.append(decode(payload).round)
                        if isinstance(decode(payload), CoordinatorStatus) else None)
    monkeypatch.setattr(heterofl.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: [agent_record("sim-0")])
    monkeypatch.setattr(heterofl.registry, "wait_for", lambda count, timeout: [agent_record("sim-0")])

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        offer(heterofl, Update(task_id, round_number, planned.agent_id, "declined", None, 0, [], {}, {},
                                         "no memory"))
        return 10

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    heterofl.run_round(1)
    heterofl.run_round(2)
    assert said == [1, 1, 2, 2]  # round 1 in progress, 1 completed, round 2 in progress, 2 completed


def test_a_task_is_sent_again_when_its_agent_comes_back_online_without_having_answered(heterofl: Coordinator,
                                                                                      monkeypatch) -> None:
    from protocol import Topics, encode

    resent: list[str] = []
    paced: list[bool] = []

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float, **options: bool) -> int:
        resent.append(task_id)
        paced.append(options.get("paced", True))
        return 0

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    tasks = {name: DispatchedTask(name, 1, task_for(heterofl, "b", agent=agent), time.time() + 60)
             for name, agent in (("r1-dev-1", "dev"), ("r1-other-1", "other"))}
    open_round(heterofl, 1, {name: dispatched.task for name, dispatched in tasks.items()})
    topic = Topics(heterofl.config.federation).agent_status("dev")
    capabilities = agent_record("dev").capabilities

    def status(state: str) -> None:
        heterofl._on_message(topic, encode(AgentStatus("dev", state, capabilities if state != "offline" else None,
                                                       time.time())))

    status("online")
    status("busy")
    assert resent == []  # online all along
    status("offline")  # its Last Will: it crashed or lost the broker
    status("online")
    assert resent == ["r1-dev-1"]  # only its own, unanswered task
    assert paced == [False]  # sent from the message thread, which must not wait on the broker
    offer(heterofl, update_for(heterofl, tasks["r1-dev-1"].task.spec, task_id="r1-dev-1", agent="dev"))
    status("offline")
    status("online")
    assert resent == ["r1-dev-1"]  # answered: nothing to send again


def test_one_agent_id_reporting_from_two_processes_is_warned_about(heterofl: Coordinator) -> None:
    import structlog

    from protocol import Topics, encode

    topic = Topics(heterofl.config.federation).agent_status("dev")
    capabilities = agent_record("dev").capabilities

    def status(state: str, instance: str) -> None:
        heterofl._on_message(topic, encode(AgentStatus("dev", state, capabilities if state != "offline" else None,
                                                       time.time(), instance)))

    with structlog.testing.capture_logs() as logs:
        status("online", "first")
        status("busy", "first")
        status("offline", "first")  # a restart says 'offline' first: no warning
        status("online", "second")
        status("online", "third")  # a restart while the broker was down (no 'offline' got out): no warning yet
        status("busy", "third")
        status("online", "second")  # ... but the replaced process still answers: two processes
    warned = [entry for entry in logs if entry["event"] == "agent_id_two_instances"]
    assert [entry["instances"] for entry in warned] == [["third", "second"]]
    assert "give every device its own agent_id" in warned[0]["message"]


def test_a_process_asking_for_a_running_agent_id_is_not_recorded_but_warned_about(heterofl: Coordinator) -> None:
    import structlog

    from protocol import Topics, encode

    topic = Topics(heterofl.config.federation).agent_status("dev")
    heterofl._on_message(topic, encode(AgentStatus("dev", "online", agent_record("dev").capabilities, time.time(),
                                                   "running")))
    with structlog.testing.capture_logs() as logs:
        heterofl._on_message(topic, encode(AgentStatus("dev", "starting", None, time.time(), "newcomer")))
    assert heterofl.registry.get("dev").instance == "running" and heterofl.registry.get("dev").online
    assert [entry["event"] for entry in logs] == ["agent_id_second_process"]


def shaped_record(agent_id: str, shape: tuple[int, ...]) -> AgentRecord:
    capabilities = Capabilities("generic", 10**12, 10**12, None, 10, list(range(10)), shape)
    return AgentRecord(agent_id, "online", capabilities, 0.0)


def test_an_agent_whose_data_does_not_fit_the_model_is_skipped_with_the_reason(heterofl: Coordinator,
                                                                               monkeypatch) -> None:
    fleet = [shaped_record("fits", (1, 8, 8)), shaped_record("fashion", (1, 28, 28))]
    monkeypatch.setattr(heterofl.registry, "wait_settled", lambda count, quiet, timeout, on_change=None: fleet)
    sent: list[str] = []

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        sent.append(planned.agent_id)
        offer(heterofl, Update(task_id, round_number, planned.agent_id, "declined", None, 0, [], {}, {},
                                         "no memory"))
        return 10

    monkeypatch.setattr(heterofl.dispatcher, "send", dispatch)
    result = heterofl.run_round(1)
    assert sent == ["fits"]
    skipped = {record.agent: record for record in result.tasks if record.status == "skipped"}
    assert "1x28x28" in skipped["fashion"].reason and "1x8x8 (digits)" in skipped["fashion"].reason


def test_no_round_is_planned_when_no_agent_data_fits(heterofl: Coordinator, monkeypatch) -> None:
    fleet = [shaped_record("a", (1, 28, 28)), shaped_record("b", (3, 32, 32))]
    monkeypatch.setattr(heterofl.registry, "wait_settled", lambda count, quiet, timeout, on_change=None: fleet)
    with pytest.raises(NoAgentsError, match=r"^the data of none of the 2 online agents of federation 'default' fits "
                                            r"the model, so no round can be planned: agent 'a': its samples are "
                                            r"1x28x28"):
        heterofl.run_round(1)


def test_the_first_round_waits_for_the_fleet_to_settle_across_the_federation_check(heterofl: Coordinator,
                                                                                   monkeypatch) -> None:
    import threading

    from coordinator import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "FEDERATIONS_CHECK_S", 0.3)
    monkeypatch.setattr(fleet_module, "REGISTRY_SETTLE_S", 0.5)
    monkeypatch.setattr(heterofl.fleet, "federations_hint", lambda: "none here")
    heterofl.config.wait_for_agents_s = 20.0
    arrived = threading.Event()

    def arrive() -> None:  # one agent just before the check, another just after it
        for name, delay in (("sim-0", 0.2), ("sim-1", 0.2)):
            time.sleep(delay)
            heterofl.registry.on_status(AgentStatus(name, "online", agent_record(name).capabilities, time.time()))
        arrived.set()

    threading.Thread(target=arrive, daemon=True).start()
    online = heterofl.fleet.wait_for_first(lambda count: None, lambda: False)
    assert arrived.is_set() and [record.agent_id for record in online] == ["sim-0", "sim-1"]


class QueuingClient:
    """paho's publish as the link sees it: every message queued under the next id, none acknowledged."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> object:
        self.payloads.append(payload)
        return type("Info", (), {"rc": 0, "mid": len(self.payloads)})()


def test_dispatch_leaves_a_window_of_chunks_in_flight_then_waits_for_the_broker(heterofl: Coordinator,
                                                                               monkeypatch) -> None:
    # A task in chunks of 512 bytes, a window of three of them, a broker that acknowledges nothing: three chunks go
    # out at once; the fourth waits for room in vain (DISPATCH_WAIT_S), and the rest go without waiting (paho
    # queues them for the broker's return) until the broker takes the backlog below the window again.
    import functools

    from coordinator import dispatch as dispatch_module
    from protocol import iter_chunks

    monkeypatch.setattr(dispatch_module, "iter_chunks", functools.partial(iter_chunks, chunk_size=512))
    monkeypatch.setattr(dispatch_module, "DISPATCH_WAIT_S", 0.01)
    client = QueuingClient()
    link = heterofl.link
    link._client = client  # type: ignore[assignment]
    planned = task_for(heterofl, "a")
    heterofl.dispatcher.send(1, "r1-dev-a", planned, time.time() + 60)  # once unpaced, to see the chunks' sizes
    sizes = [len(payload) for payload in client.payloads]
    assert len(sizes) > 5
    monkeypatch.setattr(dispatch_module, "DISPATCH_WINDOW_BYTES", sum(sizes[:3]))
    link._pending_topics.clear()
    link._in_flight = 0
    client.payloads.clear()
    with structlog.testing.capture_logs() as logs:
        sent = heterofl.dispatcher.send(1, "r1-dev-a", planned, time.time() + 60)
    assert [len(payload) for payload in client.payloads] == sizes
    assert sent == sum(sizes) == link.bytes_in_flight
    waited = [entry["in_flight"] for entry in logs if entry["event"] == "dispatch_not_paced"]
    assert waited == [sum(sizes[:3])] and heterofl.dispatcher.unpaced
    for mid in range(1, len(sizes) + 1):  # the broker is back and takes them all
        link._on_publish(None, None, mid, None, None)
    assert link.bytes_in_flight == 0
    heterofl.dispatcher.pace("r1-dev-b")
    assert not heterofl.dispatcher.unpaced  # paced again


def test_the_head_alone_is_offered_only_to_agents_whose_revision_reads_it(heterofl: Coordinator) -> None:
    from protocol import HEAD_ALONE_REVISION, PROTOCOL_REVISION, PROTOCOL_VERSION

    assert PROTOCOL_REVISION >= HEAD_ALONE_REVISION > PROTOCOL_VERSION  # a revision, not a new layout
    for name, revision in (("old", 2), ("new", PROTOCOL_REVISION)):
        capabilities = replace(agent_record(name).capabilities, protocol_version=revision)
        heterofl.registry.on_status(AgentStatus(name, "online", capabilities, time.time()))
    offer = Adaptation("depthwise", min_micro_batch=4, head_alone=True)
    assert heterofl.dispatcher.readable(offer, "new") == offer
    assert heterofl.dispatcher.readable(offer, "old") == replace(offer, head_alone=False)  # it would refuse the field
    assert heterofl.dispatcher.readable(offer, "unknown") == replace(offer, head_alone=False)
    assert heterofl.dispatcher.protocol_version("old") == heterofl.dispatcher.protocol_version("new") == PROTOCOL_VERSION


def test_ordered_dropout_is_sent_only_to_agents_whose_revision_reads_it(heterofl: Coordinator) -> None:
    from protocol import ORDERED_DROPOUT_REVISION, PROTOCOL_REVISION, Candidate, LossTerm, TrainingPlan

    assert PROTOCOL_REVISION >= ORDERED_DROPOUT_REVISION
    for name, revision in (("old", ORDERED_DROPOUT_REVISION - 1), ("new", PROTOCOL_REVISION)):
        capabilities = replace(agent_record(name).capabilities, protocol_version=revision)
        heterofl.registry.on_status(AgentStatus(name, "online", capabilities, time.time()))
    plan = TrainingPlan(loss=(LossTerm.ce(), LossTerm.width_kd()), widths=(0.5, 0.25))
    ladder = Adaptation("ladder", [Candidate({"width": 0.5}, plan), Candidate({"width": 0.25}, TrainingPlan())])
    assert heterofl.dispatcher.readable_plan(plan, "new") is plan
    assert heterofl.dispatcher.readable(ladder, "new") == ladder
    # An older agent would refuse the fields: it is sent its widest sub-model, trained on the labels alone.
    assert heterofl.dispatcher.readable_plan(plan, "old") == TrainingPlan(loss=(LossTerm.ce(),))
    assert [c.plan for c in heterofl.dispatcher.readable(ladder, "old").candidates] == [TrainingPlan()] * 2


def test_sizing_to_the_fleet_remakes_the_global_model_and_survives_a_restart(tmp_path: Path, digits) -> None:
    auto = config(tmp_path, algorithm="scalefl", model=ModelConfig(family="cnn", options={"hidden": [4, 8, 16, 32]}),
                  scalefl=ScaleFLConfig(grid_step=0.05))  # ratios: auto, cost: memory
    first = Coordinator(auto, dataset=digits)
    assert first.strategy.awaits_fleet
    before = first.strategy.global_spec()
    top = first.strategy.training_cost(before, first.strategy.level_plan(first.strategy.levels[0], 1))
    first.fit_to_fleet([top // 30, top // 6, top * 2])
    assert not first.strategy.awaits_fleet
    spec = first.strategy.global_spec()
    built = first.family.build(spec).state_dict()  # the states follow the new global model
    assert set(first.states["global"]) == set(built) and spec != before
    # Stopped in round 1 with an update stored (acked): what the sizing chose was checkpointed before any task went
    # out, so the restarted coordinator resumes round 1 with that update instead of planning it again.
    from protocol import encode

    task = task_for(first, first.strategy.levels[-1].name)
    first.files.journal.begin(1, time.time() + 60, {"r1-dev-1": task}, [])
    update = update_for(first, task.spec, task_id="r1-dev-1", agent="dev", fill=0.1)
    first.files.journal.store(update, encode(update))
    resumed = Coordinator(replace(auto, resume=True), dataset=digits)
    assert resumed.completed_rounds == 0
    assert not resumed.strategy.awaits_fleet and resumed.strategy.global_spec() == spec
    assert set(resumed.states["global"]) == set(built)
    assert resumed.in_flight.current() is not None and resumed.in_flight.current().number == 1 and list(resumed.in_flight.current().answers) == ["r1-dev-1"]
    resumed.fit_to_fleet([top])  # sized already (what the checkpoint holds): nothing changes
    assert resumed.strategy.global_spec() == spec and resumed.in_flight.current().number == 1


def test_sizing_to_the_fleet_is_refused_once_a_round_began(tmp_path: Path, digits) -> None:
    auto = config(tmp_path, algorithm="scalefl", model=ModelConfig(family="cnn", options={"hidden": [4, 8, 16, 32]}),
                  scalefl=ScaleFLConfig(grid_step=0.05))
    coordinator = Coordinator(auto, dataset=digits)
    assert coordinator.strategy.awaits_fleet
    coordinator.in_flight.install(coordinator.planner.new_round(1, {}, [], time.time() + 60))
    with pytest.raises(RuntimeError, match="before the first round"):
        coordinator.fit_to_fleet([10**9])


def test_an_agent_asking_to_upload_is_granted_in_turn_or_answered_at_once(tmp_path: Path, digits,
                                                                           monkeypatch) -> None:
    """Revision 6 on the coordinator's message thread: a request is granted while the window has room (here one
    update at a time); the whole update gives its grant back and the next request is granted; asked again once
    stored, the agent gets its ack, not a grant; an agent gone offline leaves the queue."""
    from coordinator.config import UploadsConfig
    from protocol import Ack, AgentStatus, Topics, UploadGrant, UploadRequest, decode, encode, split_payload

    coordinator = Coordinator(config(tmp_path, uploads=UploadsConfig(window_mib=0.001)), dataset=digits)
    sent: list[object] = []
    monkeypatch.setattr(coordinator.link, "publish", lambda topic, payload, **_: sent.append(decode(payload)))
    topics = Topics(coordinator.config.federation)
    task = task_for(coordinator, "b")
    tasks = {f"r2-{agent}-1": replace(task, agent_id=agent) for agent in ("a", "b", "c")}
    open_round(coordinator, 2, tasks)
    coordinator.files.journal.begin(2, time.time() + 60, tasks, [])

    def ask(agent: str) -> None:
        request = UploadRequest(f"r2-{agent}-1", 2, agent, 1000)
        coordinator._on_message(topics.agent_update(agent), encode(request))

    ask("a")
    ask("b")
    ask("c")
    assert sent == [UploadGrant("r2-a-1", 2, "a")]  # b and c wait: the window holds one update
    coordinator._on_message(topics.agent_status("c"), encode(AgentStatus("c", "offline", None, time.time())))
    assert coordinator.grants is not None and coordinator.grants.waiting == 1  # c left the queue
    update = update_for(coordinator, task.spec, task_id="r2-a-1", agent="a", round_number=2, fill=0.1)
    for chunk in split_payload(encode(update), "r2-a-1.1"):
        coordinator._on_message(topics.agent_update("a"), chunk)
    assert sent[1:] == [Ack("r2-a-1", 2, "a"), UploadGrant("r2-b-1", 2, "b")]  # stored, then b's turn
    ask("a")  # its ack was lost: asked again, it is answered, not granted
    assert sent[-1] == Ack("r2-a-1", 2, "a") and coordinator.grants.in_flight == 1000
    coordinator._on_message(topics.agent_update("x"), encode(UploadRequest("r9-x-1", 9, "x", 10)))
    assert isinstance(sent[-1], Ack) and "unknown task" in (sent[-1].reason or "")  # refused, never uploaded


def online_at(coordinator: Coordinator, agent: str, revision: int) -> None:
    """``agent`` comes online, announcing protocol ``revision``."""
    from protocol import AgentStatus, Topics, encode

    capabilities = replace(agent_record(agent).capabilities, protocol_version=revision)
    coordinator._on_message(Topics(coordinator.config.federation).agent_status(agent),
                            encode(AgentStatus(agent, "online", capabilities, time.time())))


def test_between_rounds_what_the_next_round_carries_is_held_and_taken_when_it_opens(
        tmp_path: Path, digits, monkeypatch) -> None:
    """No round collects: a request for a task the next round carries is held (counted as waiting; an agent of
    revision 7 is told to wait, an older one hears nothing yet) and so is its update sent anyway; any other is
    refused. Once the next round opens, the held update is taken (acked, aggregated one round stale) and the held
    request answered (its ack: the update is in). With ``uploads.grant`` off a request is granted at once."""
    from coordinator.config import UploadsConfig
    from coordinator.round import DispatchedTask
    from protocol import Ack, Topics, UploadGrant, UploadRequest, UploadWait, decode, encode, split_payload

    coordinator = Coordinator(config(tmp_path, uploads=UploadsConfig(grant=False), round_mode="buffered", rounds=5),
                              dataset=digits)
    sent: list[object] = []  # what agents hear (not the coordinator's status)
    topics = Topics(coordinator.config.federation)
    monkeypatch.setattr(coordinator.link, "publish", lambda topic, payload, **_: (
        None if topic == topics.coordinator_status() else sent.append(decode(payload))))
    online_at(coordinator, "a", 7)
    online_at(coordinator, "old", 6)
    task = task_for(coordinator, "b")
    carried = [DispatchedTask(f"r1-{agent}-1", 1, replace(task, agent_id=agent), time.time() + 60)
               for agent in ("a", "old")]
    coordinator.in_flight.carry(carried, {1: coordinator.states})
    coordinator._on_message(topics.agent_update("a"), encode(UploadRequest("r1-a-1", 1, "a", 10)))
    coordinator._on_message(topics.agent_update("old"), encode(UploadRequest("r1-old-1", 1, "old", 10)))
    assert [type(message) for message in sent] == [UploadWait] and sent[0].task_id == "r1-a-1"
    assert coordinator.uploads.window() == (0.0, 2.0)  # both wait, held for the next round
    update = update_for(coordinator, task.spec, task_id="r1-a-1", agent="a", round_number=1, fill=0.1)
    for chunk in split_payload(encode(update), "r1-a-1.1"):
        coordinator._on_message(topics.agent_update("a"), chunk)
    assert len(sent) == 1  # held, not acked yet
    assert coordinator.left_behind() == [("a", "r1-a-1", "carried"), ("old", "r1-old-1", "carried")]
    coordinator._on_message(topics.agent_update("b"), encode(UploadRequest("r1-b-1", 1, "b", 10)))
    assert isinstance(sent[-1], Ack) and "no round is in progress" in (sent[-1].reason or "")
    fresh = {"r2-c-1": replace(task, agent_id="c")}
    coordinator.files.journal.begin(2, time.time() + 60, fresh, [], carried, {1: coordinator.states})
    coordinator.in_flight.install(coordinator.planner.new_round(2, fresh, [], time.time() + 60, carried))
    del sent[:]
    coordinator.uploads.round_opened()
    assert sent == [Ack("r1-a-1", 1, "a"), Ack("r1-a-1", 1, "a"), UploadGrant("r1-old-1", 1, "old")]
    answer = coordinator.in_flight.current().answers["r1-a-1"]
    assert answer.aggregated and answer.record.staleness == 1
    assert coordinator.uploads.window() == (0.0, 0.0) and coordinator.uploads.held() == []
    coordinator._on_message(topics.agent_update("c"), encode(UploadRequest("r2-c-1", 2, "c", 10)))
    assert sent[-1] == UploadGrant("r2-c-1", 2, "c")  # grants off: at once


def test_a_request_queued_in_the_window_is_told_to_wait_and_answered_when_its_turn_comes_after_the_round(
        tmp_path: Path, digits, monkeypatch) -> None:
    """The window holds one update: a is granted, b (revision 7) told to wait. An older device's update (sent
    without asking) fills the buffered round's buffer of one, which stops collecting with a and b carried. a's
    update, uploading meanwhile, is held for the next round; its grant given back, b's turn comes: its update is no
    longer wanted now, so its request leaves the queue and is answered (held, told so), not dropped in silence. The
    next round takes a's update and grants b."""
    from coordinator.config import BufferedConfig, UploadsConfig
    from protocol import Ack, Topics, UploadGrant, UploadRequest, UploadWait, decode, encode, split_payload

    coordinator = Coordinator(config(tmp_path, uploads=UploadsConfig(window_mib=0.001), round_mode="buffered",
                                     buffered=BufferedConfig(size=1), rounds=5), dataset=digits)
    sent: list[object] = []  # what agents hear (not the coordinator's status)
    topics = Topics(coordinator.config.federation)
    monkeypatch.setattr(coordinator.link, "publish", lambda topic, payload, **_: (
        None if topic == topics.coordinator_status() else sent.append(decode(payload))))
    for agent in ("a", "b"):
        online_at(coordinator, agent, 7)
    task = task_for(coordinator, "b")
    tasks = {f"r1-{agent}-1": replace(task, agent_id=agent) for agent in ("a", "b", "old")}
    open_round(coordinator, 1, tasks)
    coordinator.files.journal.begin(1, time.time() + 60, tasks, [])
    for agent in ("a", "b"):
        coordinator._on_message(topics.agent_update(agent), encode(UploadRequest(f"r1-{agent}-1", 1, agent, 1000)))
    assert sent == [UploadGrant("r1-a-1", 1, "a"), UploadWait("r1-b-1", 1, "b", sent[1].reason)]
    current = coordinator.in_flight.current()

    def upload(agent: str) -> None:
        update = update_for(coordinator, task.spec, task_id=f"r1-{agent}-1", agent=agent, round_number=1, fill=0.1)
        for chunk in split_payload(encode(update), f"r1-{agent}-1.1"):
            coordinator._on_message(topics.agent_update(agent), chunk)

    upload("old")  # revision 1: sent without asking, taken outside the window
    assert current.wait()  # its buffer of one is full
    current.close()
    assert {dispatched.task_id for dispatched in current.carried_over()} == {"r1-a-1", "r1-b-1"}
    coordinator.in_flight.carry(current.carried_over(), {1: coordinator.states})
    del sent[:]
    upload("a")  # granted before the round stopped collecting, it comes after: held, and b's turn comes
    assert [type(message) for message in sent] == [UploadWait] and sent[0].task_id == "r1-b-1"
    assert coordinator.grants is not None and coordinator.grants.dropped_total == 1
    assert coordinator.uploads.held() == [("a", "r1-a-1"), ("b", "r1-b-1")]
    assert coordinator.uploads.window() == (0.0, 1.0)  # b counted once, held; a's bytes back
    fresh = {"r2-c-1": replace(task, agent_id="c")}
    coordinator.files.journal.begin(2, time.time() + 60, fresh, [], coordinator.in_flight.carried, {1: coordinator.states})
    coordinator.in_flight.install(coordinator.planner.new_round(2, fresh, [], time.time() + 60, coordinator.in_flight.carried))
    del sent[:]
    coordinator.uploads.round_opened()
    assert sent == [Ack("r1-a-1", 1, "a"), UploadGrant("r1-b-1", 1, "b")]
    assert coordinator.in_flight.current().answers["r1-a-1"].record.staleness == 1


def test_a_restart_after_a_buffered_rounds_checkpoint_carries_its_tasks_on(tmp_path: Path, digits) -> None:
    """What the next round carries is journaled with the checkpoint: a coordinator restarted then carries the tasks
    still training (one past its deadline too: the next round records it missing if its update does not come),
    and their states, and plans around them."""
    from coordinator.round import DispatchedTask

    first = Coordinator(config(tmp_path, round_mode="buffered"), dataset=digits)
    task = task_for(first, "b")
    first.files.completed_rounds = 3
    first.files.checkpoint(first.states)
    training = DispatchedTask("r3-a-1", 3, replace(task, agent_id="a"), time.time() + 600)
    over = DispatchedTask("r2-b-1", 2, replace(task, agent_id="b"), time.time() - 1)
    first.files.journal.begin(4, 0.0, {}, [], [training, over], {3: first.states, 2: first.states}, planned=False)
    restarted = Coordinator(config(tmp_path, round_mode="buffered", resume=True), dataset=digits)
    assert restarted.completed_rounds == 3 and restarted.in_flight.current() is None  # the next round is planned afresh
    assert restarted.in_flight.carried == [training, over] and restarted.in_flight.carried_ids == {"r3-a-1", "r2-b-1"}
    assert set(restarted.in_flight.bases[3]) == set(first.states) and set(restarted.in_flight.bases[2]) == set(first.states)


def test_a_stop_between_a_buffered_rounds_checkpoint_and_its_journal_loses_no_carried_task(
        tmp_path: Path, digits) -> None:
    """Killed after the checkpoint of round 3 but before the journal was replaced: the round's own journal is stale,
    and what ``carry_on`` recorded before the checkpoint is carried on."""
    from coordinator.round import DispatchedTask

    first = Coordinator(config(tmp_path, round_mode="buffered"), dataset=digits)
    task = task_for(first, "b")
    first.files.journal.begin(3, time.time() + 600, {"r3-a-1": replace(task, agent_id="a")}, [])
    training = DispatchedTask("r3-a-1", 3, replace(task, agent_id="a"), time.time() + 600)
    first.files.journal.carry_on(4, [training], {3: first.states})
    first.files.completed_rounds = 3
    first.files.checkpoint(first.states)
    restarted = Coordinator(config(tmp_path, round_mode="buffered", resume=True), dataset=digits)
    assert restarted.completed_rounds == 3 and restarted.in_flight.current() is None
    assert restarted.in_flight.carried == [training] and set(restarted.in_flight.bases[3]) == set(first.states)


def test_a_device_back_between_rounds_gets_its_carried_task_again_with_the_next_round(
        tmp_path: Path, digits, monkeypatch) -> None:
    """A restart while no round collects may lose the task a buffered round carries for it: the next round sends it
    again (its own round and deadline), and only to that device."""
    from coordinator.round import DispatchedTask
    from protocol import AgentStatus, Topics, encode

    coordinator = Coordinator(config(tmp_path, round_mode="buffered"), dataset=digits)
    topics = Topics(coordinator.config.federation)
    task = task_for(coordinator, "b")
    carried = [DispatchedTask(f"r1-{agent}-1", 1, replace(task, agent_id=agent), time.time() + 60)
               for agent in ("a", "b")]
    coordinator.in_flight.carry(carried, {1: coordinator.states})
    capabilities = agent_record("a").capabilities
    for state in ("online", "offline", "online"):  # a restarts while no round is in progress
        coordinator._on_message(topics.agent_status("a"), encode(AgentStatus(
            "a", state, capabilities if state == "online" else None, time.time())))
    sent: list[tuple[int, str]] = []
    monkeypatch.setattr(coordinator.dispatcher, "send",
                        lambda round_number, task_id, *_, **__: sent.append((round_number, task_id)) or 10)
    current = coordinator.planner.new_round(2, {}, [], time.time() + 60, carried)
    coordinator.in_flight.install(current)
    assert coordinator.dispatcher.resend_carried(current, coordinator.in_flight.take_back_online()) == 10
    assert sent == [(1, "r1-a-1")]
    assert coordinator.dispatcher.resend_carried(current, coordinator.in_flight.take_back_online()) == 0  # once


def test_a_task_carried_no_further_is_reported_as_such(tmp_path: Path, digits) -> None:
    from coordinator import reporting
    from coordinator.config import BufferedConfig
    from coordinator.round import DispatchedTask

    coordinator = Coordinator(config(tmp_path, round_mode="buffered", buffered=BufferedConfig(max_staleness=4)),
                              dataset=digits)
    task = task_for(coordinator, "b")
    old = DispatchedTask("r1-a-1", 1, replace(task, agent_id="a"), time.time() + 60)
    current = coordinator.planner.new_round(5, {}, [], time.time() - 1, [old])
    coordinator.in_flight.install(current)
    current.close()
    assert current.carried_over() == []  # 5 rounds old in round 6: more than 4
    records, _ = reporting.outcomes(current, coordinator.family, coordinator.log)
    assert records["a"].status == "missing"
    assert records["a"].reason == "still training after 5 rounds: carried no further (buffered.max_staleness 4)"


def test_a_stop_between_a_rounds_checkpoint_and_its_record_loses_no_figures(tmp_path: Path, digits) -> None:
    """The record of a round goes into its checkpoint: restarted after a stop before metrics.jsonl got it (its last
    line cut short, even), the coordinator appends it, once."""
    from coordinator.metrics import read_metrics

    first = Coordinator(config(tmp_path), dataset=digits)
    earlier = RoundResult(1, 0.5, {"a": 0.5}, 2, 2, 10, 10, 1.0, trained_levels=["b"])
    first.files.metrics.write(earlier)
    first.files.completed_rounds = 2
    first.files.checkpoint(first.states, RoundResult(2, 0.75, {"a": 0.75}, 2, 2, 10, 10, 1.5))
    with first.files.metrics.path.open("a") as handle:
        handle.write('{"round": 2, "glob')  # the stop came while the line was written
    restarted = Coordinator(config(tmp_path, resume=True), dataset=digits)
    assert [(r.round, r.global_accuracy) for r in read_metrics(restarted.files.metrics.path)] == [(1, 0.5), (2, 0.75)]
    assert restarted.files.trained_so_far.levels == {"b"}  # what the rounds trained, for the deployable model
    again = Coordinator(config(tmp_path, resume=True, metrics_port=0), dataset=digits)
    assert [r.round for r in read_metrics(again.files.metrics.path)] == [1, 2]  # once
    assert again.exporter is not None and again.exporter.accuracy.value() == 0.75  # shown until round 3 is done


def test_updates_held_for_the_next_round_stay_within_the_window_and_a_run_ends_saying_what_it_left(
        tmp_path: Path, digits, monkeypatch) -> None:
    """Whole updates held between rounds take at most the window's bytes (one at least): another is not answered
    (its agent sends it again). Without drain_last, what the last round carries is what the run left."""
    from coordinator.config import BufferedConfig, UploadsConfig
    from protocol import Topics, decode, encode, split_payload

    coordinator = Coordinator(config(tmp_path, uploads=UploadsConfig(grant=False, window_mib=0.001),
                                     round_mode="buffered", buffered=BufferedConfig(drain_last=False), rounds=1),
                              dataset=digits)
    assert coordinator.planner.new_round(1, {}, [], time.time() + 60).buffer_size is not None  # the last round: not drained
    sent: list[object] = []
    topics = Topics(coordinator.config.federation)
    monkeypatch.setattr(coordinator.link, "publish", lambda topic, payload, **_: sent.append(decode(payload)))
    task = task_for(coordinator, "b")
    carried = [DispatchedTask(f"r1-{agent}-1", 1, replace(task, agent_id=agent), time.time() + 60)
               for agent in ("a", "b")]
    coordinator.in_flight.carry(carried, {1: coordinator.states})
    for agent in ("a", "b"):
        update = update_for(coordinator, task.spec, task_id=f"r1-{agent}-1", agent=agent, round_number=1, fill=0.1)
        for chunk in split_payload(encode(update), f"r1-{agent}-1.1"):
            coordinator._on_message(topics.agent_update(agent), chunk)
    assert sent == [] and coordinator.uploads.held() == [("a", "r1-a-1")] and coordinator.uploads.not_held_total == 1
    assert coordinator.left_behind() == [("a", "r1-a-1", "carried"), ("b", "r1-b-1", "carried")]
    claim = update_for(coordinator, task.spec, task_id="r1-a-1", agent="x", round_number=1)  # another agent's
    for chunk in split_payload(encode(claim), "r1-a-1.9"):
        coordinator._on_message(topics.agent_update("x"), chunk)
    assert isinstance(sent[-1], Ack) and "unknown task" in (sent[-1].reason or "")  # not held for a's task


def test_a_checkpoints_record_of_another_version_does_not_stop_a_resume(tmp_path: Path, digits) -> None:
    """The last round's record is read for the exporter only: one this version cannot read is said in the log,
    and the run resumes."""
    first = Coordinator(config(tmp_path), dataset=digits)
    first.files.completed_rounds = 2
    first.files.checkpoint(first.states, RoundResult(2, 0.75, {"a": 0.75}, 2, 2, 10, 10, 1.5))
    states, meta = load_checkpoint(first.files.checkpoint_path)
    save_checkpoint(first.files.checkpoint_path, states, {**meta, "record": {**meta["record"], "of_later": 1}})
    restarted = Coordinator(config(tmp_path, resume=True, metrics_port=0), dataset=digits)
    assert restarted.completed_rounds == 2 and restarted.files.last_record is None


def test_levels_are_evaluated_every_levels_every_rounds_and_in_the_last(tmp_path: Path, digits, monkeypatch) -> None:
    coordinator = Coordinator(config(tmp_path, rounds=3, levels=[1.0, 0.5, 0.25],
                                     data=DataConfig(dataset="digits", bn_samples=50, eval_samples=50,
                                                     levels_every=2)), dataset=digits)
    monkeypatch.setattr(coordinator.registry, "wait_settled",
                        lambda count, quiet, timeout, on_change=None: [agent_record("sim-0")])
    monkeypatch.setattr(coordinator.registry, "wait_for", lambda count, timeout: [agent_record("sim-0")])

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        offer(coordinator, update_for(coordinator, level_spec(coordinator, "b"), task_id=task_id,
                                      agent=planned.agent_id, round_number=round_number, fill=0.1))
        return 10

    monkeypatch.setattr(coordinator.dispatcher, "send", dispatch)
    results = [coordinator.run_round(number) for number in (1, 2, 3)]
    assert [result.levels_evaluated for result in results] == [False, True, True]  # round 2 and the last
    coordinator.config.rounds = 9  # the last round of run(rounds=...) short of the total is evaluated whole too
    assert not coordinator.run_round(5).levels_evaluated and coordinator.run_round(7, last_round=7).levels_evaluated
    # between them the deployable level and what shares the global model (a), not c
    assert set(results[0].level_accuracy) == {"a", "b"}
    assert set(results[1].level_accuracy) == set(results[2].level_accuracy) == {"a", "b", "c"}
    assert all(result.deployed == "b" for result in results)


def test_a_private_round_clips_rejects_an_unclipped_update_skips_an_old_agent_and_accounts(tmp_path: Path, digits,
                                                                                            monkeypatch) -> None:
    from coordinator.privacy.ledger import PrivacyLedger
    from coordinator.privacy.settings import PrivacyConfig
    from protocol import PRIVACY_REVISION, Topics, UpdateClip

    coordinator = Coordinator(config(tmp_path, rounds=2, privacy=PrivacyConfig("central", clip=1.0,
                                                                               noise_multiplier=0.5)), dataset=digits)
    agents = [AgentRecord(name, "online", replace(agent_record(name).capabilities, protocol_version=revision), 0.0)
              for name, revision in (("clips", PRIVACY_REVISION), ("ignores", PRIVACY_REVISION),
                                     ("old", PRIVACY_REVISION - 1))]
    monkeypatch.setattr(coordinator.registry, "wait_settled", lambda count, quiet, timeout, on_change=None: agents)
    sent: list[TaskPlan] = []

    def dispatch(round_number: int, task_id: str, planned: TaskPlan, deadline: float) -> int:
        sent.append(planned)
        if planned.agent_id == "clips":  # a change of norm well within the bound
            start = coordinator.family.extract(coordinator.states["global"], planned.spec,
                                               keys=coordinator.family.trainable_keys(planned.spec))
            weights = {key: value.numpy() + np.float32(1e-4) for key, value in start.items()}
            update = Update(task_id, round_number, planned.agent_id, "ok", planned.spec.to_dict(), 10, [0, 1],
                            weights, {"loss": 0.5}, None)
        else:  # every weight set to 0.5: a change far beyond the bound
            update = update_for(coordinator, planned.spec, task_id=task_id, agent=planned.agent_id,
                                round_number=round_number, fill=0.5)
        offer(coordinator, update)
        return 10

    monkeypatch.setattr(coordinator.dispatcher, "send", dispatch)
    statuses: list[object] = []
    topic = Topics(coordinator.config.federation).coordinator_status()
    monkeypatch.setattr(coordinator.link, "publish", lambda to, payload, **_: (
        statuses.append(decode(payload)) if to == topic else None))
    result = coordinator.run_round(1)
    assert {task.agent_id for task in sent} == {"clips", "ignores"}
    assert all(task.plan.update_clip == UpdateClip(1.0, 0.0) for task in sent)
    records = {task.agent: task for task in result.tasks}
    assert records["clips"].status == "ok" and result.participants == 1
    assert records["ignores"].status == "rejected" and "above the clip bound 1 its task set" in records["ignores"].reason
    assert records["old"].status == "skipped" and "predates clipping updates" in records["old"].reason
    ledger = PrivacyLedger("rdp")
    ledger.add(0.5)
    assert result.privacy is not None and result.privacy["epsilon"] == pytest.approx(ledger.epsilon(1e-5))
    # The status says what was spent while every agent online reads it, and not once an older one is online.
    online_at(coordinator, "clips", PRIVACY_REVISION)
    spent = statuses[-1].privacy
    assert spent is not None and spent.epsilon == pytest.approx(result.privacy["epsilon"]) and spent.delta == 1e-5
    online_at(coordinator, "old", PRIVACY_REVISION - 1)  # published again at once, for the older agent to read
    assert statuses[-1].privacy is None
    # Under privacy screening keeps no update's change in the records (its norm says whether it was clipped).
    assert all(task.screening == {} for task in result.tasks)


def test_no_private_round_is_planned_when_no_agent_clips(tmp_path: Path, digits, monkeypatch) -> None:
    from coordinator.privacy.settings import PrivacyConfig

    coordinator = Coordinator(config(tmp_path, privacy=PrivacyConfig("central")), dataset=digits)
    fleet = [agent_record("old")]  # announces no revision: 1
    monkeypatch.setattr(coordinator.registry, "wait_settled", lambda count, quiet, timeout, on_change=None: fleet)
    with pytest.raises(NoAgentsError, match=r"^none of the 1 online agents of federation 'default' can serve this "
                                            r"private run, so no round can be planned: agent 'old': its protocol "
                                            r"revision 1 predates clipping updates"):
        coordinator.run_round(1)
