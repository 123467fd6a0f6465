"""A secure round's aggregate: the masked slices go into the round's `common.secagg.server.SecureServer` as they
come, and once the round is unmasked each coordinate is the mean of its sum over the devices that sent a value there
(every update weighs 1); a coordinate where none did (no one holds it, or no holder's value was hidden among three:
`common.secagg.server.SecureServer.safe`) keeps its value, and so does every coordinate of a round that could not be
unmasked."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from common.secagg.server import SecureServer
from coordinator.aggregation import RoundAggregate
from coordinator.secure.slices import secure_name
from coordinator.tasks import State, TaskResult

__all__ = ["LEFT_OUT", "SecureAggregate"]

#: Why a device's masked update is left out of its round's sum.
LEFT_OUT = ("secure aggregation: devices that dropped out left values of its update hidden among fewer than 3 "
            "senders: its update was taken out of the sum, and its values stay hidden")


class SecureAggregate(RoundAggregate):
    """See the module docstring. ``server``: the round's server once its rosters went out (None before: a masked
    slice cannot come before then); ``task_of``: the task id an update's agent holds in the round; ``unmask()``: the
    round's sums and counts once its survivors gave their shares back (None: it cannot be unmasked), asked for when
    the round wants its result (`coordinator.round.Round.finish`: it stopped collecting); ``failure()``: why not."""

    def __init__(self, states: Mapping[str, State], classifier_keys: list[str],
                 server: Callable[[], SecureServer | None], task_of: Callable[[str], str],
                 unmask: Callable[[], dict[str, tuple[np.ndarray, np.ndarray]] | None],
                 failure: Callable[[], str | None] = lambda: None,
                 left_out: Callable[[], set[str]] = set) -> None:
        super().__init__(states, lambda _result: 1.0, classifier_keys)
        self._server = server
        self._task_of = task_of
        self._unmask = unmask
        self._failure = failure
        self._left_out = left_out
        self._sums: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self._added = 0

    @property
    def updates(self) -> int:
        return self._added

    def add(self, result: TaskResult) -> None:
        """Fold a masked slice in (ValueError, folding nothing, when it is not one, or its device did not share)."""
        server = self._server()
        if result.masked is None or server is None:
            raise ValueError("a secure round folds masked slices only, after its rosters went out")
        server.add(self._task_of(result.task.agent_id), result.masked)
        self._added += 1

    def fresh(self) -> SecureAggregate:
        raise RuntimeError("a secure round's aggregate cannot be built again: screening does not run on it")

    def result(self, noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict[str, State]:
        """The new states (see the module docstring)."""
        merged = dict(self.states)
        if self._sums is None:
            self._sums = self._unmask() or {}
        if not self._sums:  # not unmasked: nothing of the round is aggregated
            self.failure = f"its secure round could not be unmasked: {self._failure() or 'no sums'}"
            return merged
        self.left_out = {agent: LEFT_OUT for agent in self._left_out()}
        for group, state in self.states.items():
            new = {}
            for key, old in state.items():
                entry = self._sums.get(secure_name(group, key))
                if entry is None:
                    new[key] = old.clone()
                    continue
                sums, counts = entry
                mean = torch.from_numpy(sums / np.maximum(counts, 1))
                new[key] = torch.where(torch.from_numpy(counts > 0), mean, old.to(mean.dtype)).to(old.dtype)
            merged[group] = new
        return merged
