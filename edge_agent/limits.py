"""What an agent accepts (the ``limits`` section of its configuration).

A module of its own, free of the MQTT client and the logging the rest of the configuration brings, because the
children of the training forkserver read the limits too (``edge_agent.workdir``): every module the forkserver
imports adds objects whose pages a child's garbage collector would touch, copy-on-write, during training.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TaskLimits:
    """What the agent accepts (the ``limits`` section): a task beyond one is declined with the reason, before any
    training. ``max_epochs`` (all stages together), ``max_steps`` (optimizer steps over the local data),
    ``max_deadline_s`` (how far ahead its deadline may lie), ``max_parameters`` (of the sub-model sent) and
    ``max_task_bytes`` (the encoded task; a larger transfer, or one whose buffer and decoded copy would not fit
    the memory available now, is declined at its first chunk, before anything is buffered)."""

    max_epochs: int = 1000
    max_steps: int = 1_000_000
    max_deadline_s: float = 6 * 3600.0
    max_parameters: int = 200_000_000
    max_task_bytes: int = 512 * 2**20

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        values = (self.max_epochs, self.max_steps, self.max_deadline_s, self.max_parameters, self.max_task_bytes)
        if any(value <= 0 for value in values):
            raise ValueError("every limits.max_* setting must be positive")
