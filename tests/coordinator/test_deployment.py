"""coordinator.deployment: a run's models cut as evaluated, each once, untrained ones left out unless asked, and
written as a folder whose graphs answer as the models do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.data import Dataset
from common.inference import open_model
from common.model_package import read_manifest, read_verified
from coordinator.deployable import GLOBAL, TrainedSoFar
from coordinator.deployment import (
    answer_macs,
    cut_models,
    ensemble_spec,
    model_groups,
    output_macs,
    write_models,
)
from coordinator.evaluation import Evaluator, accuracies
from coordinator.metrics import RoundResult
from coordinator.tasks import EvalTarget
from models import SubmodelSpec, get_family

FAMILY = get_family("cnn", 10, 1, hidden=(4, 8, 8))


def dataset() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=60)
    return Dataset("tiny", x, y, x[:40], y[:40], 10, 1, (8, 8), tuple(f"c{i}" for i in range(10)), (0.5, 0.25))


def evaluator(data: Dataset) -> Evaluator:
    return Evaluator.for_test_set(FAMILY, data, None, 0, torch.from_numpy(data.x_train))


def states() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return {GLOBAL: FAMILY.build(SubmodelSpec(exits=(0, 1))).state_dict()}


WIDTHS = {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec(), store_bn=True), "a": EvalTarget(GLOBAL, SubmodelSpec()),
          "b": EvalTarget(GLOBAL, SubmodelSpec(width=0.5)), "c": EvalTarget(GLOBAL, SubmodelSpec(width=0.25))}
EXITS = {GLOBAL: EvalTarget(GLOBAL, SubmodelSpec(exits=(0, 1)), store_bn=True),
         "1": EvalTarget(GLOBAL, SubmodelSpec(depth=1, exits=(0,))),
         "ensemble": EvalTarget(GLOBAL, SubmodelSpec(exits=(0, 1)), ensemble=True)}


def record(levels: dict[str, float], global_accuracy: float) -> RoundResult:
    return RoundResult(3, global_accuracy, levels, 4, 4, 0, 0, 1.0)


def test_each_model_once_the_untrained_left_out_and_the_deployable_one_marked() -> None:
    data = dataset()
    models, left_out = cut_models(WIDTHS, states(), FAMILY, evaluator(data), TrainedSoFar({"b", "c"}, {1}),
                                  record({"a": 0.1, "b": 0.2, "c": 0.3}, 0.1))
    # The global model is level a (one model, two names), and no device trained a.
    assert [m.name for m in models] == ["b", "c"] and left_out == [GLOBAL]
    assert [m.deployed for m in models] == [True, False] and [m.accuracy for m in models] == [0.2, 0.3]
    models, left_out = cut_models(WIDTHS, states(), FAMILY, evaluator(data), TrainedSoFar({"a", "c"}, {1}),
                                  record({"a": 0.1, "b": 0.2, "c": 0.3}, 0.1), untrained=True)
    assert [(m.name, m.aliases, m.trained, m.deployed) for m in models] == [
        (GLOBAL, ("a",), True, True), ("b", (), False, False), ("c", (), True, False)] and left_out == []
    only, _ = cut_models(WIDTHS, states(), FAMILY, evaluator(data), TrainedSoFar({"a", "c"}), None, names=["a"])
    assert [(m.name, m.accuracy) for m in only] == [(GLOBAL, None)]
    with pytest.raises(ValueError, match="no level 'z'"):
        cut_models(WIDTHS, states(), FAMILY, evaluator(data), TrainedSoFar(), None, names=["z"])


def test_a_global_model_without_levels_is_trained_when_its_last_output_is() -> None:
    alone = {GLOBAL: WIDTHS[GLOBAL]}  # FeDepth, FedRolex
    data = dataset()
    assert cut_models(alone, states(), FAMILY, evaluator(data), TrainedSoFar(set(), {1}), None)[1] == []
    assert cut_models(alone, states(), FAMILY, evaluator(data), TrainedSoFar(), None)[1] == [GLOBAL]


def test_the_cut_model_is_the_evaluated_one() -> None:
    data = dataset()
    judge = evaluator(data)
    models, _ = cut_models(WIDTHS, states(), FAMILY, judge, TrainedSoFar({"b"}), None, names=["b"])
    accuracy, _ = judge.evaluate(states()[GLOBAL], SubmodelSpec(width=0.5))
    assert accuracies(models[0].net, judge.test_x, judge.test_y) == accuracy


def test_output_costs_add_up_to_the_models() -> None:
    spec = SubmodelSpec(width=0.5, exits=(0, 1))
    net = FAMILY.build(spec)
    costs = output_macs(FAMILY, net, spec, (8, 8))
    assert len(costs) == 3 and costs == sorted(costs) and costs[-1] == FAMILY.flops(spec, (8, 8))
    assert answer_macs(FAMILY, net, spec, (8, 8), ensemble=True) == FAMILY.flops(spec, (8, 8))
    # The last output alone: the body and the final head, without the exits' heads.
    assert answer_macs(FAMILY, net, spec, (8, 8), ensemble=False) == FAMILY.flops(SubmodelSpec(width=0.5), (8, 8))


def test_the_written_folder_answers_as_the_models(tmp_path: Path) -> None:
    data = dataset()
    judge = evaluator(data)
    trained = TrainedSoFar({"1"}, {1, 2, 3})
    models, _ = cut_models(EXITS, states(), FAMILY, judge, trained, record({"1": 0.4, "ensemble": 0.5}, 0.3))
    manifest = write_models(tmp_path, models, FAMILY, data, judge, algorithm="depthfl", family_name="cnn",
                            model_options={"hidden": [4, 8, 8]}, round_number=3, source="test")
    assert read_manifest(tmp_path) == manifest
    assert manifest.input.mean == 0.5 and manifest.classes[3] == "c3" and manifest.round == 3
    assert [e.name for e in manifest.models] == [GLOBAL, "1", "ensemble"] and manifest.deployed().name == "ensemble"
    x = judge.test_x.numpy()
    for entry, model in zip(manifest.models, models):
        assert entry.inference_bytes > 0 and entry.parameters == FAMILY.param_count(model.spec)
        assert entry.exit_accuracy == tuple(accuracies(model.net, judge.test_x, judge.test_y,
                                                       ensemble=bool(model.members), members=model.members))
        assert len(entry.stages) == (entry.outputs if entry.outputs > 1 else 0)
        read_verified(tmp_path, entry.state)  # its digest holds
        with torch.no_grad():
            outputs = model.net.forward_exits(judge.test_x)
        expected = torch.stack(outputs).mean(0) if model.members else outputs[-1]
        for backend in ("onnxruntime", "torch"):
            np.testing.assert_allclose(open_model(tmp_path, manifest, entry, backend).logits(x), expected.numpy(),
                                       atol=1e-4)


def test_models_are_grouped_under_one_name_and_trained_as_their_levels_say() -> None:
    groups = {g.name: g for g in model_groups(WIDTHS, FAMILY, TrainedSoFar({"b", "c"}, {1}))}
    # The global model is level a: untrained though every update reached its head (its own slice is a's).
    assert set(groups) == {"global", "b", "c"} and groups["global"].aliases == ("a",)
    assert not groups["global"].trained and groups["b"].trained and groups["b"].deployed


def test_an_ensemble_is_cut_after_its_last_member() -> None:
    spec = SubmodelSpec(exits=(0, 1))
    assert ensemble_spec(spec, FAMILY, (0, 1)) == SubmodelSpec(depth=2, exits=(0, 1))
    assert ensemble_spec(spec, FAMILY, (0, 2)) == spec  # the final head is a member: the whole model
    data = dataset()
    judge = evaluator(data)
    models, _ = cut_models(EXITS, states(), FAMILY, judge, TrainedSoFar({"1"}, {1, 2}), None, names=["ensemble"])
    (ensemble,) = models
    assert ensemble.spec == SubmodelSpec(depth=2, exits=(0, 1)) and ensemble.members == (0, 1)
    whole = judge.prepare(states()[GLOBAL], SubmodelSpec(exits=(0, 1)))
    with torch.no_grad():
        outputs = whole.forward_exits(judge.test_x)
        cut = ensemble.net.forward_exits(judge.test_x)
    torch.testing.assert_close(torch.stack(cut).mean(0), (outputs[0] + outputs[1]) / 2)
