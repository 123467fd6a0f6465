"""Tests for models.layers: Scaler and static batch norm."""

from __future__ import annotations

import pytest
import torch

from models.layers import Scaler, static_bn


def test_scaler_divides_in_training_only() -> None:
    scaler = Scaler(0.25)
    x = torch.randn(2, 3, 4, 4)
    scaler.train()
    assert torch.allclose(scaler(x), x * 4)
    scaler.eval()
    assert torch.equal(scaler(x), x)


def test_scaler_has_no_state_and_rejects_bad_rates() -> None:
    assert Scaler(0.5).state_dict() == {}
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="rate"):
            Scaler(bad)


def test_scaler_full_rate_is_identity_in_training() -> None:
    x = torch.randn(5, requires_grad=True)
    out = Scaler(1.0).train()(x)
    assert out is x  # no copy: nothing allocated, nothing kept for backward
    assert Scaler(0.5).train()(x) is not x


def test_static_bn_without_tracking_has_no_statistics() -> None:
    bn = static_bn(6, track_running_stats=False)
    assert list(bn.state_dict()) == ["weight", "bias"]
    assert bn.momentum is None and bn.affine
    # Eval still normalises with batch statistics.
    x = torch.randn(8, 6, 3, 3) * 5 + 2
    y = bn.eval()(x)
    assert torch.allclose(y.mean(dim=(0, 2, 3)), torch.zeros(6), atol=1e-5)


def test_static_bn_with_tracking_uses_cumulative_average() -> None:
    bn = static_bn(2, track_running_stats=True)
    assert set(bn.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    a = torch.randn(4, 2, 3, 3) + 1.0
    b = torch.randn(4, 2, 3, 3) - 3.0
    bn.train()
    with torch.no_grad():
        bn(a)
        bn(b)
    expected = (a.mean(dim=(0, 2, 3)) + b.mean(dim=(0, 2, 3))) / 2
    assert bn.running_mean is not None and bn.num_batches_tracked is not None
    assert torch.allclose(bn.running_mean, expected, atol=1e-5)
    assert int(bn.num_batches_tracked) == 2
