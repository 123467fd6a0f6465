"""ScaleFL (Ilhan, Su and Liu, CVPR 2023): split the model in width and depth, with early exits and
self-distillation among them.

Set-up (Alg. 1 lines 2-4): for each level ``l`` with target cost ratio ``r_l`` the split search of Eq. 1
(:mod:`coordinator.split_search`) finds the most balanced depth and width ratios ``(s_d, s_w)``; the level keeps
the first ``floor(s_d * N)`` of the ``N`` blocks with an early exit after the last of them (0-based block
``floor(s_d * N) - 1``) and ``floor(s_w * channels)`` of every hidden layer.
The global model is the full model with the exits of every level. A level's cost is that of its sub-model as it
is trained, its exits included, against the global model's: by default the model-dependent part of its estimated
training memory (what the budgets devices report limit), or, as in the paper, its parameters or FLOPs.

Levels are named ``1`` (smallest) to ``L`` (the full model). Clients are mapped to the highest level whose
estimated training memory fits the budget they report (``fix``; the paper maps by a budget of the cost, a
device reports memory), or sampled per round (``dynamic``); one that cannot afford its level falls to a lower
level nested in it. A level-``l`` sub-model has the exits of levels ``1..l`` and trains them with Eq. 5,
``1/(l(l+1)) * sum_i i * (beta * KL_tau(y_i || y_l) + CE(y_i, y))``, the last exit the teacher. Aggregation is
Eq. 2: per element, the mean over the participants whose sub-model holds it (layers beyond a client's exit are
untouched by it), i.e. masked aggregation. Each round the global model is evaluated at every exit, and each
level's sub-model at its last exit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from coordinator.levels import Level, affordable_share, fleet_shares
from coordinator.method_settings.scalefl import SCALEFL_RATIOS
from coordinator.split_search import NoSplitError, search_levels
from coordinator.strategies.base import StrategyContext
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from protocol import LossTerm, TrainingPlan

__all__ = ["ScaleFL", "self_distillation_loss"]


def self_distillation_loss(outputs: int, *, beta: float, tau: float, distill: bool = True,
                           detach_teacher: bool = False, masked: bool = False,
                           normalization: str = "paper") -> tuple[LossTerm, ...]:
    """ScaleFL's Eq. 5 for a sub-model with ``outputs`` exits, as loss terms.

    ``L = c * sum_{i=1..l} i * (beta * KL_tau(y_i || y_l) + CE(y_i, y))`` with ``c = 1/(l(l+1))`` (``paper``)
    or ``2/(l(l+1))`` (``reference``: the weights sum to 1); the last exit ``y_l`` is the teacher (its own KL term
    is zero and left out). ``distill=False`` keeps only the cross-entropy terms (the reference code's first
    quarter of the rounds).
    """
    if outputs < 1:
        raise ValueError(f"a sub-model has at least one output, got {outputs}")
    if normalization not in ("paper", "reference"):
        raise ValueError(f"normalization must be 'paper' or 'reference', got {normalization!r}")
    scale = (1.0 if normalization == "paper" else 2.0) / (outputs * (outputs + 1))
    terms = [LossTerm.ce(weight=scale * i, output=i - 1, masked=masked) for i in range(1, outputs + 1)]
    if distill and beta > 0:
        terms += [LossTerm.kd(i - 1, outputs - 1, weight=scale * i * beta, tau=tau, detach_teacher=detach_teacher)
                  for i in range(1, outputs)]
    return tuple(terms)


#: How many times ``ratios: auto`` sizes the levels again against the top level the last search settled on.
SIZING_ROUNDS = 5
#: ``ratios: auto``: the tolerance a level no split reaches within ``scalefl.tolerance`` of its share is searched
#: again with (from a third of its share up to it) before it is given up.
WIDEST_TOLERANCE = 0.5


class ScaleFL(LevelStrategy):
    """Width-and-depth split levels with early exits and self-distillation (see the module docstring)."""

    name = "scalefl"

    def __init__(self, context: StrategyContext) -> None:
        self.settings = context.config.scalefl
        #: The (ratios, tolerances) sized from the fleet's budgets (``ratios: auto``), once it reported them.
        self.fitted: tuple[list[float], list[float]] | None = None
        #: The exits of the top level those ratios are shares of: the search of the levels starts from that global
        #: model (from the plain one, a share of the top is read against a model without its exits' cost).
        self.start_exits: tuple[int, ...] = ()
        super().__init__(context)

    def setting_to_shrink(self) -> str:
        if self.by_fleet:
            return ("a larger memory budget, or fixed scalefl.ratios with a smaller first one (auto sized the levels "
                    "to the budgets the fleet reported at its first round)")
        return f"a smaller first ratio in scalefl.ratios (now {self.targets()[0][0]:g})"

    @property
    def by_fleet(self) -> bool:
        """Whether the levels are sized from the fleet's budgets: ``ratios: auto`` with the ``memory`` cost."""
        return self.settings.ratios == "auto" and self.settings.cost == "memory"

    @property
    def awaits_fleet(self) -> bool:
        return self.by_fleet and self.fitted is None

    def targets(self) -> tuple[list[float], list[float]]:
        """The levels' target ratios and tolerances: fitted to the fleet, or the configured (fixed) ones."""
        if self.fitted is not None:
            return self.fitted
        return self.settings.fixed_ratios(), self.settings.tolerances()

    def fit_to_fleet(self, budgets: Sequence[int]) -> str | None:
        """``ratios: auto``: one level per cluster of the devices' affordable shares of the top level's memory cost
        (:meth:`_fit_against`), so that every device of the cluster can train it; the top level is the one the
        search settles on (see the comment below)."""
        if not self.by_fleet:
            return None
        if not budgets or all(budget >= self.cost(self.levels[0]) for budget in budgets):
            # nothing reported, or every device trains the top level: the fixed ladder (its exits and Eq. 5)
            self.fitted = (self.settings.fixed_ratios(), self.settings.tolerances())
            self.start_exits = ()
            self._levels = None
            return ("scalefl.ratios auto: " + ("no budgets reported" if not budgets else
                                               "every device can train the top level") + ", the fixed ratios")
        # The search's ratios are of the top level as it trains (the full model with the exits the levels below
        # give it, Eq. 5): the devices' shares are taken of that model. Its exits depend on the levels, and the
        # levels on the shares, so it starts from the costliest top (an exit after every block it allows: no
        # level found costs more than its devices can train) and sizes again against the top each search settles
        # on (shares of the costliest top understated them by about 40% on PreResNet-20). That need not settle
        # (a top can cost more than the one its shares were of, and passes can alternate): the pass that serves
        # the fleet best is kept, the first one (the costliest top's) among them.
        top = replace(SubmodelSpec.full(), exits=tuple(self.family.exit_points))
        passes: list[tuple[tuple[int, int], tuple[list[float], list[float]], list[float], tuple[int, ...]]] = []
        for _ in range(SIZING_ROUNDS):
            wanted = self._fit_against(top, budgets)
            assert self.fitted is not None
            passes.append((self._service(budgets), self.fitted, wanted, self.start_exits))
            settled = self.global_spec()
            if settled == top:
                break
            top = settled
        best = max(range(len(passes)), key=lambda index: (passes[index][0], -index))
        if best != len(passes) - 1:
            _, self.fitted, wanted, self.start_exits = passes[best]
            self._levels = None
        dropped = len(wanted) - len(self.levels)  # a share no split reaches is dropped by the search
        costs = [float(level.info["cost_ratio"]) for level in reversed(self.levels)]  # where they sit, not targets
        return (f"scalefl.ratios auto: levels at {', '.join(f'{r:.3g}' for r in costs)} of the top "
                f"level's training memory, from {len(budgets)} reported budget{'s' * (len(budgets) != 1)}"
                + (f" ({dropped} share{'s' * (dropped != 1)} too small to split)" if dropped else ""))

    def _service(self, budgets: Sequence[int]) -> tuple[int, int]:
        """How well the levels serve devices of these ``budgets``: how many train a level, and the training memory
        of the levels they train, summed (the larger, the more of the model each learns)."""
        answers = [self.plan_for_budget(budget) for budget in budgets]
        served = [answer for answer in answers if answer.get("trains", "nothing") != "nothing"]
        return len(served), sum(int(answer.get("train_bytes") or 0) for answer in served)

    def _fit_against(self, top: SubmodelSpec, budgets: Sequence[int]) -> list[float]:
        """Fit the levels to the devices' affordable shares of ``top``'s training memory (one level per cluster,
        :func:`coordinator.levels.fleet_shares`), each searched in a window that ends at its share: a target of
        ``share / (1 + eps)`` within ``eps`` (``scalefl.tolerance``), so that the level costs between
        ``(1 - eps) / (1 + eps)`` of the share and the share; the shares wanted."""
        overhead = self.context.training_memory(top, self._plan(self.family.num_outputs(top), distill=True)).overhead
        full = self.memory_cost(top)
        shares = [affordable_share(budget, overhead, full, self.context.device_factor) for budget in budgets]
        wanted = fleet_shares(shares, most=len(SCALEFL_RATIOS))
        tolerance = self.settings.tolerances()[0]
        self.fitted = ([share / (1 + tolerance) for share in wanted[:-1]] + [1.0],
                       [tolerance] * (len(wanted) - 1) + [0.0])
        self.start_exits = tuple(top.exits)
        self._levels = None
        return wanted

    def make_levels(self) -> list[Level]:
        settings = self.settings
        cost: str | Callable[[SubmodelSpec], float] = settings.cost
        if settings.cost == "memory":
            cost = self.memory_cost
        ratios, tolerances = self.targets()
        while True:
            try:
                found = search_levels(self.family, ratios, tolerances, cost=cost, input_size=self.context.input_size,
                                      step=settings.grid_step, start_exits=self.start_exits)
                break
            except NoSplitError as exc:
                if not self.by_fleet or len(ratios) == 1:
                    raise ValueError(f"ScaleFL cannot split model {self.family.name!r}: {exc}; change "
                                     "scalefl.ratios or widen scalefl.tolerance") from None
                ratios, tolerances = _widen_or_drop_smallest(ratios, tolerances)  # (auto)
                if self.fitted is not None:
                    self.fitted = (ratios, tolerances)
        levels = []
        for number, level in enumerate(found, start=1):
            split = level.split
            exit_block: int | str = split.blocks - 1 if split.blocks < self.family.num_blocks else "final"
            levels.append(Level(str(number), level.spec, {
                "s_d": split.s_d, "s_w": split.s_w, "blocks": f"{split.blocks}/{self.family.num_blocks}",
                "exit_block": exit_block, "target_ratio": level.target,
                "cost_ratio": split.ratio, "tolerance": level.tolerance, "cost": settings.cost}))
        return levels[::-1]

    def memory_cost(self, spec: SubmodelSpec) -> float:
        """The ``memory`` cost of the split search: the model-dependent part of the estimated training memory of
        ``spec`` trained as a level (its exits with Eq. 5) at the recipe's batch size, as the agents estimate it
        (the runtime's fixed overhead, the same for every model, is left out, as in the simulator's budgets)."""
        outputs = self.family.num_outputs(spec)
        estimate = self.context.training_memory(spec, self._plan(outputs, distill=True))
        return float(estimate.total - estimate.overhead)

    def _plan(self, outputs: int, *, distill: bool) -> TrainingPlan:
        settings = self.settings
        beta = settings.beta / (self.family.num_classes if settings.kd_reduction == "mean" else 1)
        return self.recipe_plan(self_distillation_loss(
            outputs, beta=beta, tau=settings.tau, distill=distill, detach_teacher=settings.detach_teacher,
            masked=self.masked_ce, normalization=settings.normalization))

    def global_spec(self) -> SubmodelSpec:
        """The full model with every level's exit."""
        return self.levels[0].spec

    def state_dict(self) -> dict[str, Any]:
        """The ratios fitted to the fleet (``ratios: auto``), so that a resumed run keeps its levels."""
        if self.fitted is None:
            return {}
        return {"fitted": [list(part) for part in self.fitted],
                **({"start_exits": list(self.start_exits)} if self.start_exits else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) - {"fitted", "start_exits"}:
            raise ValueError(f"ScaleFL's state holds {sorted(state)}, expected only 'fitted' and 'start_exits'")
        if "fitted" in state and not self.by_fleet:
            raise ValueError("the checkpoint's ScaleFL levels were sized to the fleet (scalefl.ratios: auto, cost: "
                             "memory); resume with those settings, or use another state_dir")
        if "fitted" in state:
            ratios, tolerances = ([float(value) for value in part] for part in state["fitted"])
            self.fitted = (ratios, tolerances)
            self.start_exits = tuple(int(block) for block in state.get("start_exits", ()))
            self._levels = None

    def distilling(self, round_number: int) -> bool:
        """Whether the round's plans distil (off for the first ``kd_warmup`` share of the rounds)."""
        return round_number > self.settings.kd_warmup * self.config.rounds

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        return self._plan(self.family.num_outputs(level.spec), distill=self.distilling(round_number))


def _widen_or_drop_smallest(ratios: list[float], tolerances: list[float]) -> tuple[list[float], list[float]]:
    """(auto) The smallest level, which no split reaches: searched again in the widest window below its share
    (:data:`WIDEST_TOLERANCE`), else given up (no device of its cluster can train a level of this model)."""
    if tolerances[0] < WIDEST_TOLERANCE:
        share = ratios[0] * (1 + tolerances[0])
        return [share / (1 + WIDEST_TOLERANCE), *ratios[1:]], [WIDEST_TOLERANCE, *tolerances[1:]]
    return ratios[1:], tolerances[1:]
