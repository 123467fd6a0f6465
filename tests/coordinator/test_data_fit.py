"""Whether an agent's data fits the model, from what its status reports."""

from __future__ import annotations

from coordinator.data_fit import data_misfit
from protocol import Capabilities


def capabilities(shape: tuple[int, ...], labels: list[int]) -> Capabilities:
    return Capabilities("pi", 2**31, 2**30, None, 100, labels, shape)


def test_data_of_the_model_shape_and_classes_fits() -> None:
    assert data_misfit(capabilities((1, 28, 28), list(range(10))), (1, 28, 28), 10, "fashion-mnist") is None


def test_samples_of_another_shape_do_not_fit_and_the_reason_names_both_shapes() -> None:
    reason = data_misfit(capabilities((1, 8, 8), list(range(10))), (1, 28, 28), 10, "fashion-mnist")
    assert reason is not None and "1x8x8" in reason and "1x28x28 (fashion-mnist)" in reason


def test_labels_beyond_the_model_classes_do_not_fit() -> None:
    reason = data_misfit(capabilities((1, 8, 8), [0, 3, 12]), (1, 8, 8), 10, "digits")
    assert reason is not None and "up to 12" in reason and "10 classes" in reason


def test_an_agent_that_reports_no_shape_is_checked_on_its_labels_only() -> None:
    assert data_misfit(capabilities((), [0, 9]), (1, 28, 28), 10, "fashion-mnist") is None
    assert data_misfit(None, (1, 28, 28), 10, "fashion-mnist") is None
