"""Static-BN statistics, per-output accuracies and the Evaluator on a tiny CNN (with and without early exits)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.evaluation import Evaluator, accuracies, channels_last, recompute_bn_statistics
from models import Scaler, SubmodelSpec, get_family


@pytest.fixture
def family():
    return get_family("cnn", 10, 1, hidden=(4, 8))


def capture_bn_inputs(model: nn.Module) -> tuple[dict[str, list[torch.Tensor]], list]:
    captured: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            captured[name] = []
            handles.append(module.register_forward_pre_hook(
                lambda mod, inputs, name=name: captured[name].append(inputs[0].detach().clone())))
    return captured, handles


@pytest.mark.parametrize("batch_size", [500, 8, 4])
def test_running_mean_is_per_channel_mean_of_bn_input(family, batch_size):
    torch.manual_seed(0)
    model = family.build(SubmodelSpec.uniform(0.5))
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.fill_(100.0)  # stale statistics must be discarded
    captured, handles = capture_bn_inputs(model)
    x = torch.randn(16, 1, 8, 8) * 2 + 1
    recompute_bn_statistics(model, x, batch_size=batch_size)
    for handle in handles:
        handle.remove()
    assert set(captured) == {"bn1", "bn2"}
    for name, inputs in captured.items():
        bn = getattr(model, name)
        seen = torch.cat(inputs)
        assert seen.shape[0] == 16
        torch.testing.assert_close(bn.running_mean, seen.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
        assert int(bn.num_batches_tracked) == -(-16 // batch_size)
    assert not model.training


def test_running_mean_with_uneven_last_batch_is_mean_over_sample(family):
    torch.manual_seed(0)
    model = family.build()
    captured, handles = capture_bn_inputs(model)
    x = torch.randn(10, 1, 8, 8) + torch.arange(10.0).view(10, 1, 1, 1)  # batches differ in mean
    recompute_bn_statistics(model, x, batch_size=4)
    for handle in handles:
        handle.remove()
    seen = torch.cat(captured["bn1"])
    torch.testing.assert_close(model.bn1.running_mean, seen.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-4)


def test_scalers_stay_in_eval_mode_during_recompute(family):
    model = family.build(SubmodelSpec.uniform(0.5))
    modes: list[bool] = []
    for module in model.modules():
        if isinstance(module, Scaler):
            module.register_forward_pre_hook(lambda mod, inputs: modes.append(mod.training))
    bn_modes: list[bool] = []
    model.bn1.register_forward_pre_hook(lambda mod, inputs: bn_modes.append(mod.training))
    recompute_bn_statistics(model, torch.randn(6, 1, 8, 8))
    assert modes and not any(modes)
    assert bn_modes == [True]


class ConstantOutputs(nn.Module):
    """Stands in for a FamilyNet: output ``i`` always predicts class ``classes[i]``."""

    def __init__(self, *classes: int, num_classes: int = 5) -> None:
        super().__init__()
        self.classes = classes
        self.num_classes = num_classes
        self.batches = 0

    @property
    def num_outputs(self) -> int:
        return len(self.classes)

    def forward_exits(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.batches += 1
        outputs = []
        for cls in self.classes:
            logits = torch.zeros(len(x), self.num_classes)
            logits[:, cls] = 1.0
            outputs.append(logits)
        return outputs


def test_accuracies_of_constant_predictors_are_shares_of_their_classes():
    y = torch.tensor([3, 3, 1, 0, 3, 2, 4, 3, 1, 0])  # four 3s, one 4, two 1s
    x = torch.zeros(len(y), 1, 2, 2)
    model = ConstantOutputs(3, 4, 1).train()
    assert accuracies(model, x, y, batch_size=3) == pytest.approx([0.4, 0.1, 0.2])
    assert model.batches == 4  # batches of 3: 3 + 3 + 3 + 1
    assert not model.training
    assert accuracies(ConstantOutputs(4), x, y) == pytest.approx([0.1])


def test_accuracies_of_empty_set_are_zero():
    empty = accuracies(ConstantOutputs(0, 1), torch.zeros(0, 1, 2, 2), torch.zeros(0, dtype=torch.long))
    assert empty == [0.0, 0.0]


def test_accuracies_of_a_family_net_follow_its_outputs():
    torch.manual_seed(3)
    exits_family = get_family("cnn", 10, 1, hidden=(4, 8, 8))
    model = exits_family.build(SubmodelSpec(exits=(0, 1))).eval()
    x, y = torch.randn(25, 1, 8, 8), torch.randint(0, 10, (25,))
    with torch.no_grad():
        expected = [float((logits.argmax(1) == y).float().mean()) for logits in model.forward_exits(x)]
    assert len(expected) == 3
    assert accuracies(model, x, y, batch_size=7) == pytest.approx(expected)


def test_an_ensemble_averages_the_logits_of_its_members_only():
    """DepthFL's ensemble of its trained classifiers: the mean of those outputs' logits; none named: all of them."""
    torch.manual_seed(5)
    model = get_family("cnn", 10, 1, hidden=(4, 8, 8)).build(SubmodelSpec(exits=(0, 1))).eval()
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    with torch.no_grad():
        outputs = model.forward_exits(x)

    def ensemble_of(chosen: list[int]) -> float:
        mean = torch.stack([outputs[index] for index in chosen]).mean(dim=0)
        return float((mean.argmax(1) == y).float().mean())

    assert accuracies(model, x, y, ensemble=True)[-1] == pytest.approx(ensemble_of([0, 1, 2]))
    assert accuracies(model, x, y, ensemble=True, members=[0, 1])[-1] == pytest.approx(ensemble_of([0, 1]))
    assert accuracies(model, x, y, ensemble=True, members=[2])[-1] == pytest.approx(ensemble_of([2]))
    with pytest.raises(ValueError, match="not outputs"):
        accuracies(model, x, y, ensemble=True, members=[3])


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_evaluator_returns_accuracy_and_bn_statistics(family, rate):
    torch.manual_seed(1)
    state = family.build().state_dict()
    bn_x = torch.randn(12, 1, 8, 8)
    test_x, test_y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    evaluator = Evaluator(family, bn_x, test_x, test_y)
    spec = SubmodelSpec.uniform(rate)
    accs, bn_state = evaluator.evaluate(state, spec)
    assert len(accs) == 1 and 0.0 <= accs[0] <= 1.0
    expected_keys = {f"bn{i}.{suffix}" for i in (1, 2)
                     for suffix in ("running_mean", "running_var", "num_batches_tracked")}
    assert set(bn_state) == expected_keys
    kept = family.kept_channels(spec)
    assert bn_state["bn1.running_mean"].shape == (kept["conv1"],)
    assert bn_state["bn2.running_var"].shape == (kept["conv2"],)
    assert int(bn_state["bn1.num_batches_tracked"]) == 1
    assert not torch.equal(bn_state["bn1.running_mean"], torch.zeros(kept["conv1"]))  # really recomputed


def test_evaluator_accuracy_matches_prepared_model(family):
    torch.manual_seed(2)
    state = family.build().state_dict()
    x, y = torch.randn(30, 1, 8, 8), torch.randint(0, 10, (30,))
    evaluator = Evaluator(family, x[:10], x, y)
    spec = SubmodelSpec.uniform(0.5)
    model = evaluator.prepare(state, spec)
    with torch.no_grad():
        expected = float((model(x).argmax(1) == y).float().mean())
    accs, _ = evaluator.evaluate(state, spec)
    assert accs == pytest.approx([expected])


def test_evaluator_reports_every_exit_and_their_bn_statistics():
    # Exit heads with a convolution have their own BN layers: their statistics are recomputed too.
    torch.manual_seed(4)
    family = get_family("cnn", 10, 1, hidden=(4, 8, 8), exit_convs=1)
    global_spec = SubmodelSpec(exits=(0, 1))
    state = family.build(global_spec).state_dict()
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    evaluator = Evaluator(family, x[:16], x, y)
    accs, bn_state = evaluator.evaluate(state, global_spec)
    model = evaluator.prepare(state, global_spec)
    with torch.no_grad():
        expected = [float((logits.argmax(1) == y).float().mean()) for logits in model.forward_exits(x)]
    assert len(accs) == 3 and accs == pytest.approx(expected)
    for head in ("exits.0.bn1", "exits.1.bn1"):
        assert int(bn_state[f"{head}.num_batches_tracked"]) == 1
        assert not torch.equal(bn_state[f"{head}.running_mean"], state[f"{head}.running_mean"])
    # A cut sub-model: the outputs are its exits only, the last one after its last block.
    cut = SubmodelSpec(width=0.5, rounding="floor", depth=2, exits=(0, 1))
    accs, bn_state = evaluator.evaluate(state, cut)
    assert len(accs) == 2
    assert "bn3.running_mean" not in bn_state and bn_state["exits.1.bn1.running_mean"].shape == (4,)


def test_accuracy_is_the_same_in_either_memory_order_and_any_batch_size(family):
    # The evaluator runs its convolutions in channels-last order, a batch at a time: the same outputs as the
    # model in its default order on the whole set at once (up to float rounding).
    torch.manual_seed(5)
    state = family.build().state_dict()
    x, y = torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,))
    evaluator = Evaluator(family, x[:20], x, y)
    model = evaluator.prepare(state, SubmodelSpec.full())
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    plain = family.build()
    plain.load_state_dict(model.state_dict())
    plain.eval()
    with torch.no_grad():
        expected_logits = plain(x)
        torch.testing.assert_close(model(channels_last(x)), expected_logits, rtol=1e-4, atol=1e-5)
    expected = float((expected_logits.argmax(1) == y).float().mean())
    assert accuracies(model, x, y, batch_size=7) == accuracies(model, x, y) == pytest.approx([expected])
