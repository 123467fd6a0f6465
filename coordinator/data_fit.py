"""Whether an agent's data fits the model: the shape of its samples and its labels, as its status reports them."""

from __future__ import annotations

from collections.abc import Sequence

from protocol import Capabilities


def data_misfit(capabilities: Capabilities | None, sample_shape: Sequence[int], num_classes: int,
                dataset: str) -> str | None:
    """Why an agent's data cannot train this model (one sentence), or None when it fits. ``sample_shape`` is the
    model's input (channels, height, width). An agent that reports no sample shape (older agents) is checked on its
    labels only."""
    if capabilities is None:
        return None
    expected = tuple(sample_shape)
    reported = tuple(capabilities.sample_shape)
    if reported and reported != expected:
        return (f"its samples are {'x'.join(map(str, reported))} (channels x height x width) but the model takes "
                f"{'x'.join(map(str, expected))} ({dataset}); give the agent data of the coordinator's dataset or "
                f"run the coordinator on the agents' dataset")
    too_high = [label for label in capabilities.labels if label >= num_classes]
    if too_high:
        return (f"its labels go up to {max(too_high)} but the model has {num_classes} classes ({dataset}); give the "
                f"agent data of the coordinator's dataset")
    return None
