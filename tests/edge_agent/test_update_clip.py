"""edge_agent.update_clip: the change scaled to the bound when longer, kept when shorter; local noise of the asked
scale, never the coordinator's to redraw; a change that cannot be clipped is refused."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.update_clip import change_norm, clip_update
from protocol import UpdateClip


def tensors(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"conv.weight": (scale * rng.normal(size=(4, 3, 3, 3))).astype(np.float32),
            "fc.bias": (scale * rng.normal(size=10)).astype(np.float32)}


def test_a_long_change_is_scaled_to_the_bound_along_its_direction_and_a_short_one_is_kept() -> None:
    sent = tensors(0)
    trained = {key: value + delta for (key, value), delta in zip(sent.items(), tensors(1).values())}
    norm = change_norm(trained, sent)
    assert norm > 2.0
    clipped, before = clip_update(trained, sent, UpdateClip(2.0))
    assert before == pytest.approx(norm)
    assert change_norm(clipped, sent) == pytest.approx(2.0, rel=1e-5)
    for key in sent:  # the same direction, shortened
        np.testing.assert_allclose(clipped[key] - sent[key], (trained[key] - sent[key]) * 2.0 / norm, atol=1e-5)
        assert clipped[key].dtype == np.float32
    kept, _ = clip_update(trained, sent, UpdateClip(norm * 2))
    for key in sent:
        np.testing.assert_allclose(kept[key], trained[key], atol=1e-6)


def test_local_noise_has_the_asked_scale_and_differs_every_time() -> None:
    sent = {"w": np.zeros(200_000, dtype=np.float32)}
    trained = {"w": np.full(200_000, 1e-3, dtype=np.float32)}
    first, _ = clip_update(trained, sent, UpdateClip(0.1, noise_multiplier=2.0))
    second, _ = clip_update(trained, sent, UpdateClip(0.1, noise_multiplier=2.0))
    # The clipped change spread over 200k values is 0.1 / sqrt(200k) each; the noise's standard deviation 0.2.
    assert float(np.std(first["w"])) == pytest.approx(0.2, rel=0.02)
    assert not np.array_equal(first["w"], second["w"])  # drawn from the system's entropy, not a seed


def test_a_change_that_cannot_be_clipped_is_refused() -> None:
    sent = tensors(0)
    with pytest.raises(ValueError, match="not one the task sent"):
        clip_update({**sent, "extra": np.zeros(2, dtype=np.float32)}, sent, UpdateClip(1.0))
    with pytest.raises(ValueError, match="not one the task sent with its shape"):
        clip_update({"fc.bias": np.zeros(11, dtype=np.float32)}, sent, UpdateClip(1.0))
    broken = {**sent, "fc.bias": np.full(10, np.nan, dtype=np.float32)}
    with pytest.raises(ValueError, match="not finite"):
        clip_update(broken, sent, UpdateClip(1.0))
