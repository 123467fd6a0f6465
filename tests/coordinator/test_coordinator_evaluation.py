"""Static-BN statistics, accuracy and the Evaluator on a tiny CNN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.evaluation import Evaluator, accuracy, recompute_bn_statistics
from models import Scaler, SubmodelSpec, get_family


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


class ConstantClass(nn.Module):
    def __init__(self, cls: int, num_classes: int = 5) -> None:
        super().__init__()
        self.cls = cls
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(x), self.num_classes)
        logits[:, self.cls] = 1.0
        return logits


def test_accuracy_of_constant_predictor_is_share_of_that_class():
    y = torch.tensor([3, 3, 1, 0, 3, 2, 4, 3, 1, 0])  # four 3s
    x = torch.zeros(len(y), 1, 2, 2)
    model = ConstantClass(3).train()
    assert accuracy(model, x, y, batch_size=3) == pytest.approx(0.4)
    assert not model.training
    assert accuracy(ConstantClass(4), x, y) == pytest.approx(0.1)


def test_accuracy_of_empty_set_is_zero():
    assert accuracy(ConstantClass(0), torch.zeros(0, 1, 2, 2), torch.zeros(0, dtype=torch.long)) == 0.0


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_evaluator_returns_accuracy_and_bn_statistics(family, rate):
    torch.manual_seed(1)
    state = family.build().state_dict()
    bn_x = torch.randn(12, 1, 8, 8)
    test_x, test_y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    evaluator = Evaluator(family, bn_x, test_x, test_y)
    spec = SubmodelSpec.uniform(rate)
    acc, bn_state = evaluator.evaluate(state, spec)
    assert 0.0 <= acc <= 1.0
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
    acc, _ = evaluator.evaluate(state, spec)
    assert acc == pytest.approx(expected)
