"""The model a user would deploy from a run, and its accuracy: the round's headline.

The global model's last output is not always a model anyone trained: under the papers' own budgets no device may
train ScaleFL's or DepthFL's top level, or HeteroFL's full width on a fleet whose strongest tier cannot hold it.
The headline is therefore the model a user would put on a device:

- a method with an ensemble of its classifiers (DepthFL): the ensemble of the classifiers some update has trained
  so far (its paper's headline, the mean of their logits);
- a method with levels (HeteroFL, FjORD, ScaleFL, FlexFL, AdaptiveFL, Decoupled, the baselines): the largest level
  (by parameters) some update has trained so far, at its own last output; named ``global`` when it is the global
  model itself;
- a method without levels (FeDepth, FedRolex), or one none of whose levels was trained yet: the global model.

"So far" is over the run's rounds (:class:`TrainedSoFar`, rebuilt from ``metrics.jsonl`` on resume): a level
trained once keeps being deployable, its weights updated since by the tasks that share them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.logs import Logger
from coordinator.metrics import RoundResult, read_metrics
from coordinator.tasks import EvalTarget
from models import ModelFamily

__all__ = ["GLOBAL", "TrainedSoFar", "deployed", "deployed_name"]

#: The name of the global model as an evaluation target and as the deployed model.
GLOBAL = "global"


@dataclass
class TrainedSoFar:
    """The evaluation targets (levels) and the global model's outputs (1-based) some aggregated update has trained
    in the run's rounds so far."""

    levels: set[str] = field(default_factory=set)
    exits: set[int] = field(default_factory=set)

    def add(self, levels: Iterable[str], exits: Iterable[int]) -> None:
        """A round's trained levels and outputs (``reporting.trained``)."""
        self.levels.update(levels)
        self.exits.update(exits)

    @classmethod
    def from_results(cls, results: Iterable[RoundResult]) -> TrainedSoFar:
        """What the recorded rounds ``results`` trained (their ``trained_levels`` and ``trained_exits``; a record of a
        global model with one output keeps no ``trained_exits``: a round that aggregated an update trained it, as
        every update reaches the classifier)."""
        trained = cls()
        for result in results:
            exits = [int(name.removeprefix("exit")) for name in result.trained_exits]
            if not result.exit_accuracy and result.participants:
                exits.append(1)
            trained.add(result.trained_levels, exits)
        return trained

    @classmethod
    def of_run(cls, metrics: Path, completed: int, log: Logger) -> TrainedSoFar:
        """What a run's ``completed`` rounds trained, read from its ``metrics`` (``metrics.jsonl``): nothing for a
        new run, and nothing (said in the log) where a damaged record cannot be read: the deployable model is then
        chosen from the rounds to come."""
        if not completed:
            return cls()
        try:
            return cls.from_results(read_metrics(metrics))
        except ValueError as exc:
            log.warning("trained_so_far_unread", error=str(exc))
            return cls()

    def members(self) -> list[int]:
        """The trained outputs, 0-based: the members of an ensemble of trained classifiers."""
        return sorted(number - 1 for number in self.exits)


def deployed_name(targets: Mapping[str, EvalTarget], family: ModelFamily, trained: TrainedSoFar) -> str:
    """The deployable model among the round's evaluation ``targets`` (see the module docstring)."""
    ensemble = next((name for name, target in targets.items() if target.ensemble), None)
    if ensemble is not None:
        return ensemble
    whole = targets[GLOBAL]
    levels = {name: target for name, target in targets.items() if name != GLOBAL and name in trained.levels}
    if not levels:
        return GLOBAL
    largest = max(levels, key=lambda name: (family.param_count(levels[name].spec), name))
    if (levels[largest].spec, levels[largest].group) == (whole.spec, whole.group):
        return GLOBAL
    return largest


def deployed(targets: Mapping[str, EvalTarget], family: ModelFamily, trained: TrainedSoFar,
             accuracies: Mapping[str, list[float]]) -> tuple[str, float]:
    """The deployable model among the round's evaluation ``targets`` (:func:`deployed_name`) and its accuracy,
    read from the round's ``accuracies`` (``reporting.evaluate_targets``: the global model's every output, a
    level's last, an ensemble's one)."""
    name = deployed_name(targets, family, trained)
    return name, accuracies[name][-1]
