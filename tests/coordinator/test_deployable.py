"""coordinator.deployable: the model a user would deploy is the headline, never an output no device trained."""

from __future__ import annotations

from coordinator.deployable import GLOBAL, TrainedSoFar, deployed
from coordinator.metrics import RoundResult
from coordinator.strategies.base import EvalTarget
from models import SubmodelSpec, get_family

FAMILY = get_family("cnn", 10, 1, hidden=(4, 8, 8))
WIDTHS = {"a": 1.0, "b": 0.5, "c": 0.25}


def width_targets() -> dict[str, EvalTarget]:
    """HeteroFL's: the global model (the full width) and its levels a (the same model), b and c."""
    return {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec.full(), store_bn=True),
            **{name: EvalTarget(GLOBAL, SubmodelSpec.uniform(width)) for name, width in WIDTHS.items()}}


ACCURACIES = {GLOBAL: [0.10], "a": [0.10], "b": [0.80], "c": [0.70]}


def test_the_largest_level_some_device_trained_is_deployed() -> None:
    targets = width_targets()
    assert deployed(targets, FAMILY, TrainedSoFar({"b", "c"}), ACCURACIES) == ("b", 0.80)
    assert deployed(targets, FAMILY, TrainedSoFar({"c"}), ACCURACIES) == ("c", 0.70)


def test_the_global_model_when_its_own_level_is_trained_or_nothing_is() -> None:
    targets = width_targets()
    assert deployed(targets, FAMILY, TrainedSoFar({"a", "c"}), ACCURACIES) == (GLOBAL, 0.10)
    assert deployed(targets, FAMILY, TrainedSoFar(), ACCURACIES) == (GLOBAL, 0.10)
    alone = {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec.full(), store_bn=True)}  # FeDepth, FedRolex: no levels
    assert deployed(alone, FAMILY, TrainedSoFar({"x"}), {GLOBAL: [0.6]}) == (GLOBAL, 0.6)


def test_an_ensemble_is_deployed_where_the_method_has_one() -> None:
    targets = {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec(exits=(0, 1)), store_bn=True),
               "1": EvalTarget(GLOBAL, SubmodelSpec(depth=1, exits=(0,))),
               "ensemble": EvalTarget(GLOBAL, SubmodelSpec(exits=(0, 1)), ensemble=True)}
    accuracies = {GLOBAL: [0.5, 0.6, 0.1], "1": [0.5], "ensemble": [0.65]}
    assert deployed(targets, FAMILY, TrainedSoFar({"1"}, {1, 2}), accuracies) == ("ensemble", 0.65)


def test_what_was_trained_so_far_is_read_back_from_the_records() -> None:
    def record(number: int, levels: list[str], exits: list[str]) -> RoundResult:
        return RoundResult(number, 0.1, {}, 1, 1, 0, 0, 1.0, trained_levels=levels, trained_exits=exits)

    trained = TrainedSoFar.from_results([record(1, ["c"], ["exit1"]), record(2, ["b"], ["exit3", "exit1"])])
    assert trained == TrainedSoFar({"b", "c"}, {1, 3}) and trained.members() == [0, 2]
    trained.add(["a"], [2])
    assert trained.levels == {"a", "b", "c"} and trained.members() == [0, 1, 2]


def test_a_round_that_aggregated_an_update_trained_a_global_model_of_one_output() -> None:
    # A model of one output keeps no trained_exits in its records (and no exit accuracies): live, its one head was
    # reached by every update, and read back it is too (a run resumed or exported sees what the live one saw).
    def record(number: int, participants: int) -> RoundResult:
        return RoundResult(number, 0.1, {}, participants, 1, 0, 0, 1.0)

    assert TrainedSoFar.from_results([record(1, 0)]) == TrainedSoFar()
    assert TrainedSoFar.from_results([record(1, 0), record(2, 3)]) == TrainedSoFar(set(), {1})
    several = RoundResult(1, 0.1, {}, 2, 2, 0, 0, 1.0, exit_accuracy={"exit1": 0.1, "exit2": 0.2},
                          trained_exits=["exit1"])
    assert TrainedSoFar.from_results([several]) == TrainedSoFar(set(), {1})


def test_a_run_whose_records_cannot_be_read_starts_from_nothing_trained(tmp_path) -> None:
    import structlog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1, "glob\n{"round": 2}\n')  # damaged before its last line
    assert TrainedSoFar.of_run(path, 2, structlog.get_logger()) == TrainedSoFar()
    assert TrainedSoFar.of_run(tmp_path / "none.jsonl", 0, structlog.get_logger()) == TrainedSoFar()
