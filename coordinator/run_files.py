"""A run's files in its ``state_dir``, and what they say when a coordinator starts.

- ``checkpoint.safetensors``: the global model's states after the rounds completed, the strategy's state, and the
  last round's record (`coordinator.checkpoint`);
- ``metrics.jsonl``: one record a round (`coordinator.metrics`), restored from the checkpoint when a stop came
  between the two;
- ``round/``: the round journal (`coordinator.journal`): the round in progress's tasks and its stored updates, and
  what the next buffered round carries.

A closed round is written in an order that loses nothing at any stop: what the next round carries beside the
round's own journal, then the checkpoint, then the journal moved on (:meth:`RunFiles.round_done`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from common.logs import Logger
from coordinator import deployable
from coordinator.checkpoint import checkpoint_metadata, save_checkpoint, starting_states
from coordinator.config import CoordinatorConfig
from coordinator.journal import RoundJournal
from coordinator.metrics import MetricsWriter, RoundResult
from coordinator.planning import model_options
from coordinator.round import DispatchedTask
from coordinator.strategies.base import Strategy
from coordinator.tasks import State
from protocol import ModelRef

__all__ = ["RunFiles"]


class RunFiles:
    """The checkpoint, the metrics and the journal of one run (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, strategy: Strategy, model_ref: ModelRef, log: Logger) -> None:
        self._config = config
        self._strategy = strategy
        state_dir = Path(config.state_dir)
        self.checkpoint_path = state_dir / "checkpoint.safetensors"
        self.metrics = MetricsWriter(state_dir / "metrics.jsonl")
        self.journal = RoundJournal(state_dir / "round", model_ref)
        self._log = log
        #: The rounds the checkpoint holds.
        self.completed_rounds = 0
        #: The record of the last round completed (None: none; a resumed run's, read from its checkpoint).
        self.last_record: RoundResult | None = None
        #: What the run's rounds trained so far: the deployable model is the largest of it (`coordinator.deployable`).
        self.trained_so_far = deployable.TrainedSoFar()

    def open(self) -> dict[str, State]:
        """Read what the files hold (a new run: nothing) and return the states to start from: the checkpoint's, else
        the strategy's initial ones. A record the checkpoint has and ``metrics.jsonl`` lacks is written there."""
        states, self.completed_rounds = starting_states(self.checkpoint_path, self._config, self._strategy)
        if self.completed_rounds:
            self._log.info("resumed", round=self.completed_rounds, checkpoint=str(self.checkpoint_path))
            record = checkpoint_metadata(self.checkpoint_path).get("record")
            if self.metrics.restore(self.completed_rounds, record):
                self._log.warning("round_record_restored", round=self.completed_rounds,
                                  reason="stopped after the round's checkpoint, before metrics.jsonl had its record")
            try:
                self.last_record = RoundResult.from_dict(record) if record is not None else None
            except ValueError as exc:  # another version's record: the run goes on without it (the exporter's)
                self._log.warning("last_round_record_unread", round=self.completed_rounds, reason=str(exc))
        self.trained_so_far = deployable.TrainedSoFar.of_run(self.metrics.path, self.completed_rounds, self._log)
        return states

    def checkpoint(self, states: dict[str, State], record: RoundResult | None = None) -> None:
        """Write the checkpoint of the rounds completed, with the last one's ``record`` (what ``metrics.jsonl``
        gets next, restored from here by a coordinator that restarts before it got it)."""
        config = self._config
        save_checkpoint(self.checkpoint_path, states, {
            "round": self.completed_rounds, "algorithm": config.algorithm, "family": config.model.family,
            "model_options": model_options(config), "federation": config.federation,
            "strategy": self._strategy.state_dict(), **({"record": record.to_dict()} if record is not None else {})})

    def round_done(self, number: int, states: dict[str, State], record: RoundResult, *, buffered: bool,
                   carried: Sequence[DispatchedTask], bases: dict[int, dict[str, State]]) -> None:
        """Round ``number`` closed with these ``states`` and its ``record``: leave the journal what the next round
        carries (nothing, after a synchronous round), recorded beside the round's own journal before the checkpoint
        so that a stop between the two loses no carried task; then checkpoint; then move the journal on."""
        self.completed_rounds = number
        self.last_record = record
        if buffered:
            self.journal.carry_on(number + 1, carried, bases)
        self.checkpoint(states, record)
        if carried:  # the checkpoint holds the round now, the journal what the next one carries
            self.journal.begin(number + 1, 0.0, {}, [], carried, bases, planned=False)
        else:
            self.journal.clear()
