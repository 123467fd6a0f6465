"""The strategy interface: the server half of a method, in the shape of Flower's strategies.

A strategy is set up once (:class:`StrategyContext`: the model family, the server's own data, the configuration
and a training-memory estimator); it may choose levels or exits there. Each round it turns the online agents
into task plans (:meth:`Strategy.configure_round`), combines what came back (:meth:`Strategy.begin_aggregate`: masked
aggregation by default, each update folded in as it is accepted, the weighting its own choice), and learns from the outcomes (:meth:`Strategy.observe`).
Its state (:meth:`Strategy.state_dict`) is saved in the checkpoint and restored on resume. The daemon keeps
only transport, deadlines, collection, update validation, evaluation and checkpoints.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from common.device_need import INITIAL_FACTOR, device_need
from coordinator.aggregation import RoundAggregate
from coordinator.config import CoordinatorConfig, RecipeConfig
from coordinator.registry import AgentRecord
from coordinator.tasks import EvalTarget, IndexMap, RoundPlan, Skip, State, TaskOutcome, TaskPlan, TaskResult
from models import MemoryEstimate, ModelFamily, SubmodelSpec
from protocol import LossTerm, OptimizerSettings, TrainingPlan

__all__ = [  # the round's values (coordinator.tasks) are re-exported: a strategy imports what it needs from here
    "EvalTarget", "IndexMap", "RoundPlan", "Skip", "State", "Strategy", "StrategyContext", "TaskOutcome", "TaskPlan",
    "TaskResult", "base_plan", "select_fraction",
]

@dataclass(frozen=True)
class StrategyContext:
    """What a strategy is set up with.

    ``server_x``/``server_y`` is data the server may use (a sample of the training distribution: the static-BN
    sample); ``training_memory(spec, plan)`` estimates the peak memory of training ``spec`` with ``plan`` on an
    agent, with its parts (:class:`models.MemoryEstimate`); ``training_sample(count)`` draws ``count`` examples
    of the server's training split (of ``training_size``; never the test split): the proxy data of methods that
    pre-train. ``device_factor``: the calibration factor a device applies to the estimate's model-dependent part
    before it trains (a fresh agent's: :data:`common.device_need.INITIAL_FACTOR`).
    """

    family: ModelFamily
    config: CoordinatorConfig
    input_size: tuple[int, int]
    server_x: torch.Tensor
    server_y: torch.Tensor
    training_memory: Callable[[SubmodelSpec, TrainingPlan], MemoryEstimate]
    training_sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    training_size: int = 0
    device_factor: float = INITIAL_FACTOR


def base_plan(recipe: RecipeConfig, loss: Sequence[LossTerm] | None = None, *, masked: bool = False) -> TrainingPlan:
    """The training plan of the configured recipe: SGD, its epochs and batch size, plain (``masked``: masked) CE
    unless ``loss`` says otherwise. The seed is set per task by the daemon."""
    return TrainingPlan(
        optimizer=OptimizerSettings("sgd", recipe.lr, recipe.momentum, recipe.weight_decay, recipe.clip_norm),
        epochs=recipe.epochs,
        batch_size=recipe.batch_size,
        loss=tuple(loss) if loss is not None else (LossTerm.ce(masked=masked),),
    )


def select_fraction(agents: Sequence[AgentRecord], fraction: float, rng: random.Random) -> list[AgentRecord]:
    """FedAvg's client sampling: ``fraction`` of the online agents (at least one) at random, sorted by id."""
    if not agents:
        return []
    count = max(1, round(fraction * len(agents)))
    return sorted(rng.sample(list(agents), count), key=lambda a: a.agent_id)


class Strategy(ABC):
    """The server half of a method (see the module docstring).

    Every method implements two calls: :meth:`configure_round` (who trains what this round) and
    :meth:`eval_targets` (which models are evaluated and reported). The rest have defaults, overridden where the
    method differs, in five groups (the sections below):

    - set-up: :meth:`global_spec`, :meth:`groups` (the model states kept), :meth:`initial_states`;
    - rounds: :meth:`begin_aggregate` and :meth:`weight` (how updates combine; :meth:`aggregate` folds a list at
      once), :meth:`observe` (learning from how tasks ended), :meth:`level_of` and :meth:`trained_targets` (naming
      what an update trained);
    - sized to the fleet: :attr:`awaits_fleet`, :meth:`fit_to_fleet` (``auto`` settings sized from the budgets);
    - what it serves (``fedfit plan``, the start-of-run statement): :meth:`describe`, :meth:`plan_for_budget`,
      :meth:`nothing_fits`, :meth:`setting_to_shrink`, :meth:`largest_whole_model`, :meth:`setup_summary`,
      with :meth:`training_cost` (the bytes a device needs for a task);
    - checkpoint: :meth:`state_dict`, :meth:`load_state_dict`.

    A method's tasks start from :meth:`recipe_plan` (the configured recipe, its cross-entropy masked as
    :attr:`masked_ce` says).
    """

    name: ClassVar[str] = ""
    #: Whether the method's paper trains with masked cross-entropy (``recipe.masked_ce`` left out follows it).
    masked_ce_by_default: ClassVar[bool] = False

    def __init__(self, context: StrategyContext) -> None:
        self.context = context
        self.family = context.family
        self.config = context.config

    @property
    def masked_ce(self) -> bool:
        """Whether this run's cross-entropy terms mask absent classes: ``recipe.masked_ce``, else the method's
        default."""
        configured = self.config.recipe.masked_ce
        return self.masked_ce_by_default if configured is None else configured

    def recipe_plan(self, loss: Sequence[LossTerm] | None = None) -> TrainingPlan:
        """:func:`base_plan` of the configured recipe, masked as :attr:`masked_ce` says."""
        return base_plan(self.config.recipe, loss, masked=self.masked_ce)

    # ------------------------------------------------------------------ set-up
    def global_spec(self) -> SubmodelSpec:
        """The spec of the global model's state (the full model; ScaleFL adds its exits)."""
        return SubmodelSpec.full()

    def groups(self) -> list[str]:
        """Names of the model states this strategy keeps (one global model, or one per level)."""
        return ["global"]

    def initial_states(self, seed: int) -> dict[str, State]:
        """Initial weights of every group: the global spec built with ``seed`` (BN statistics included)."""
        torch.manual_seed(seed)
        initial = self.family.build(self.global_spec()).state_dict()
        return {group: {k: v.clone() for k, v in initial.items()} for group in self.groups()}

    # ------------------------------------------------------------------ rounds
    @abstractmethod
    def configure_round(self, round_number: int, agents: Sequence[AgentRecord], rng: random.Random) -> RoundPlan:
        """Select among the online ``agents`` and plan each selected one's task."""

    def begin_aggregate(self, states: Mapping[str, State]) -> RoundAggregate:
        """The round's aggregate, into which its validated updates are folded as they come (masked aggregation,
        weighted by :meth:`weight`)."""
        return RoundAggregate(states, self.weight, self.family.classifier_keys())

    def aggregate(self, round_number: int, results: Sequence[TaskResult],
                  states: Mapping[str, State]) -> dict[str, State]:
        """Combine validated updates into new states at once (:meth:`begin_aggregate` folding each)."""
        aggregate = self.begin_aggregate(states)
        for result in results:
            aggregate.add(result)
        return aggregate.result()

    def weight(self, result: TaskResult) -> float:
        """Aggregation weight of an update: 1 (HeteroFL, ScaleFL) or its sample count (``weighting: samples``)."""
        return float(max(1, result.num_samples)) if self.config.weighting == "samples" else 1.0

    def observe(self, round_number: int, outcomes: Sequence[TaskOutcome]) -> None:
        """Learn from how the round's tasks ended (default: nothing)."""

    @abstractmethod
    def eval_targets(self) -> dict[str, EvalTarget]:
        """Name -> model to evaluate: ``"global"`` (the reported global model: every output of it is reported,
        its last output is the global accuracy) and one per level (its last output)."""

    def level_of(self, spec: SubmodelSpec) -> str | None:
        """The name of the level (or pool model) whose sub-model ``spec`` is, wherever it sits in the global
        model (its roll aside), if any (default: one of the evaluation targets)."""
        return next((name for name, target in self.eval_targets().items()
                     if name != "global" and target.spec == spec.unrolled()), None)

    def trained_targets(self, spec: SubmodelSpec, targets: Mapping[str, EvalTarget]) -> set[str]:
        """Which of the round's evaluation ``targets`` (besides the global model and ensembles) an aggregated update
        of ``spec`` trained (default: those whose sub-model ``spec`` is, its roll aside)."""
        return {name for name, target in targets.items()
                if name != "global" and not target.ensemble and target.spec == spec.unrolled()}

    # ------------------------------------------------------------------ sized to the fleet
    @property
    def awaits_fleet(self) -> bool:
        """Whether what this strategy hands out is to be sized from the budgets the fleet reports
        (:meth:`fit_to_fleet`) and has not been yet (default: never)."""
        return False

    def fit_to_fleet(self, budgets: Sequence[int]) -> str | None:
        """Size what the strategy hands out to the devices' ``budgets`` (bytes, as they report them), where its
        settings say ``auto``; a sentence of what it chose, None where nothing is sized by the fleet. The
        caller then makes the initial states again (the global model may change)."""
        return None

    # ------------------------------------------------------------------ what it serves
    def training_cost(self, spec: SubmodelSpec, plan: TrainingPlan) -> int:
        """The bytes a fresh agent must have available to train ``spec`` with ``plan``, by its own rule (the
        estimated peak with the agent's initial calibration margin: :func:`common.device_need.device_need`): what
        its reported budget must hold."""
        return device_need(self.context.training_memory(spec, plan), self.context.device_factor)

    def describe(self) -> list[dict[str, Any]]:
        """What each level or pool model would be, for ``fedfit plan``: at least ``name`` and ``spec``."""
        return [{"name": name, "spec": target.spec} for name, target in self.eval_targets().items()
                if name != "global"]

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """What a device reporting ``budget`` bytes would be handed (for ``fedfit plan --budgets`` and the
        start-of-run statement, :mod:`coordinator.serving`): ``trains`` (a level, a pool model, ``"nothing"``...);
        where nothing fits, ``needs_bytes`` (the least its smallest option needs) and ``to_fit``
        (:meth:`setting_to_shrink`)."""
        return {}

    def setting_to_shrink(self) -> str:
        """The setting that would make this method's smallest option smaller, in a few words."""
        return "a larger memory budget"

    def largest_whole_model(self) -> str | None:
        """The name of the largest model this strategy hands out whole (the one whose deepest parts only it
        holds), None where every device's training reaches the whole model (FeDepth's blocks)."""
        return None

    def nothing_fits(self, needs: int) -> dict[str, Any]:
        """:meth:`plan_for_budget`'s answer for a device whose budget fits nothing: the least it would need."""
        return {"trains": "nothing", "needs_bytes": int(needs), "to_fit": self.setting_to_shrink()}

    def setup_summary(self) -> dict[str, Any]:
        """What the strategy's set-up computed beyond its levels (e.g. FlexFL's scores), for ``fedfit plan``."""
        return {}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state kept across rounds (saved in the checkpoint)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"strategy {self.name!r} keeps no state, but the checkpoint holds {sorted(state)}")
