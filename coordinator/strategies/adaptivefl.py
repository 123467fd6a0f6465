"""AdaptiveFL (Jia et al., 2024): a pool of fine-grained (r_w, I) sub-models, local pruning to what the device
can afford now, and client selection that learns from what comes back which device to give which model.

Pool (Step 1, the paper's Table 1): per width ``r_w`` of ``adaptivefl.widths`` and value of ``I`` of
``adaptivefl.full_layers`` the sub-model keeping its first ``I`` layers whole and ``r_w`` of the later ones
(:mod:`models.fine_grained`); width 1 is the full model ``L1``. Models are named by type and rank: VGG-16's
``L1 (1, -)``, ``M1 (0.66, 8)``, ``M2 (0.66, 6)``, ``M3 (0.66, 4)``, ``S1 (0.4, 8)``, ``S2 (0.4, 6)``,
``S3 (0.4, 4)``.

Rounds (Algorithm 1): ``fraction`` of the online agents are given a model each: a model drawn uniformly from the
pool (Step 2), then a client drawn by the RL tables of :mod:`coordinator.client_selection` (Step 3), each client at
most once. The budgets agents report are never used to choose (the paper's server cannot know them). Every task
carries the pool models nested in its model as its adaptation ladder, largest first (Step 4): an agent that cannot
train what it received trains the largest of them that fits its memory now and says which, and the tables learn
from that (or from a decline). Plain cross-entropy; aggregation (Algorithm 2) is masked and weighted by the samples
each update trained on. Every pool model is evaluated each round. The tables are strategy state: saved with the
checkpoint, restored on resume.

Two settings depart from or choose within the paper (see :mod:`coordinator.client_selection`):
``adaptivefl.readmit_after`` (K, default 5) re-admits a client whose every score fell to 0 (the paper's rule
leaves it out for good, even after one passing shortage) by resetting its resource table once it has been out K
rounds, so no device is kept out of the draws for more than K rounds (0 or null: the paper's strict rule);
``adaptivefl.large_divisor`` divides the L type's resource reward by p (``paper``, the default: the paper's
formula) or by 1 (``reference``: the reference code).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.client_selection import PoolEntry, SelectionTables
from coordinator.levels import Level
from coordinator.metrics import TaskStatus
from coordinator.registry import AgentRecord
from coordinator.strategies.base import RoundPlan, StrategyContext, TaskOutcome, TaskPlan, TaskResult
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from models.fine_grained import default_full_layers, fine_grained_spec
from protocol import MEMORY_DECLINE_REASON, MEMORY_KILL_REASON, Adaptation, Candidate

__all__ = ["TYPE_NAMES", "AdaptiveFL"]

#: Model types (levels), largest width first.
TYPE_NAMES = ("L", "M", "S", "XS", "XXS")
#: 2: the tables carry ``out_since`` (re-admission); version 1 states (without it) still load.
STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)


class AdaptiveFL(LevelStrategy):
    """The (r_w, I) pool, RL client selection and local pruning down the nested pool (see the module docstring)."""

    name = "adaptivefl"

    def __init__(self, context: StrategyContext) -> None:
        self.settings = context.config.adaptivefl
        #: The widths sized to the fleet's weakest devices (``widths: auto``), once the fleet reported its budgets.
        self.fitted: list[float] | None = None
        super().__init__(context)
        self.tables = self._new_tables()

    def _new_tables(self) -> SelectionTables:
        pool = [PoolEntry(level.name, level.info["type"]) for level in reversed(self.levels)]
        return SelectionTables(pool, self.per_type, cap=self.settings.success_cap,
                               large_divisor=self.settings.large_divisor, readmit_after=self.settings.readmit_after)

    # ------------------------------------------------------------------ sized to the fleet
    @property
    def widths(self) -> list[float]:
        """The widths r_w of the types, largest first: fitted to the fleet, or the configured (fixed) ones."""
        return list(self.fitted) if self.fitted is not None else self.settings.fixed_widths()

    @property
    def awaits_fleet(self) -> bool:
        return self.settings.widths == "auto" and self.fitted is None

    def smallest_need(self, width: float) -> int:
        """What a device needs to train the pool's smallest model at ``width`` (its smallest I kept whole)."""
        level = Level("S", fine_grained_spec(self.family, width, min(self.full_layers)), {})
        return self.cost(level)

    def fit_to_fleet(self, budgets: Sequence[int]) -> str | None:
        """``widths: auto``: the smallest type's width narrowed (on a grid of 0.01, never below 0.01) until its
        smallest model fits the weakest budget of the fleet that any width can serve, by the device's rule; the
        paper's widths where they fit it already. Budgets below what the whole shallow layers alone need are
        served by no width (:meth:`setting_to_shrink` says so)."""
        if self.settings.widths != "auto":
            return None
        fixed = self.settings.fixed_widths()
        floor = self.smallest_need(0.01)
        weakest = min((budget for budget in budgets if budget >= floor), default=None)
        chosen = fixed
        if weakest is not None and self.smallest_need(fixed[-1]) > weakest:
            grid = [round(fixed[-1] - 0.01 * step, 2) for step in range(1, round(fixed[-1] * 100))]
            width = next((w for w in grid if self.smallest_need(w) <= weakest), None)
            if width is not None:
                chosen = [*fixed[:-1], width]
        unserved = sum(1 for budget in budgets if budget < floor)
        self.fitted = chosen
        self._levels = None
        self.tables = self._new_tables()
        text = (f"adaptivefl.widths auto: the paper's {', '.join(f'{w:g}' for w in fixed)}" if chosen == fixed else
                f"adaptivefl.widths auto: {', '.join(f'{w:g}' for w in chosen)}, the smallest type narrowed so that "
                f"the weakest budget any width can serve trains its smallest model")
        return text + (f"; {unserved} of {len(budgets)} budgets {'lies' if unserved == 1 else 'lie'} below what any "
                       f"width needs: {self.setting_to_shrink()}"
                       if unserved else "")

    # ------------------------------------------------------------------ pool
    @property
    def full_layers(self) -> list[int]:
        """The values of I, largest first (configured, or the family's default)."""
        settings = self.settings
        if settings.full_layers is not None:
            return list(settings.full_layers)
        return default_full_layers(self.family, minimum=settings.min_full_layers)

    @property
    def per_type(self) -> int:
        """p: the models per level below L."""
        return len(self.full_layers)

    def make_levels(self) -> list[Level]:
        layers = len(self.family.prunable_layers())
        depths = self.full_layers
        if not depths:
            raise ValueError(f"AdaptiveFL finds no value of I for {self.family.name!r} ({layers} prunable layers) "
                             f"with adaptivefl.min_full_layers {self.settings.min_full_layers}")
        if max(depths) >= layers:
            raise ValueError(f"adaptivefl.full_layers {depths}: I must be below the {layers} prunable layers of "
                             f"{self.family.name!r} (I = {layers} is the full model)")
        levels: list[Level] = []
        for kind, width in zip(TYPE_NAMES, self.widths):
            if width == 1.0:
                levels.append(Level(f"{kind}1", SubmodelSpec.full(), {"type": kind, "r_w": 1.0, "I": "-"}))
                continue
            for rank, depth in enumerate(depths, start=1):
                levels.append(Level(f"{kind}{rank}", fine_grained_spec(self.family, width, depth),
                                    {"type": kind, "r_w": width, "I": depth}))
        specs = [level.spec for level in levels]
        if len(set(specs)) != len(specs):
            raise ValueError("AdaptiveFL's pool holds two identical models: choose other adaptivefl.widths or "
                             "full_layers")
        return levels

    # ------------------------------------------------------------------ rounds
    def configure_round(self, round_number: int, agents: Sequence[AgentRecord], rng: random.Random) -> RoundPlan:
        """Algorithm 1, lines 6-8: a model from the pool, then a client for it, ``fraction`` of the agents; first
        the clients out for ``readmit_after`` rounds are re-admitted."""
        plan = RoundPlan()
        self.tables.readmit(round_number)
        if not agents:
            return plan
        by_name = {level.name: level for level in self.levels}
        count = max(1, round(self.config.fraction * len(agents)))
        for model, agent in self.tables.assign(count, [a.agent_id for a in agents], rng, self.settings.selection):
            level = by_name[model]
            plan.tasks.append(TaskPlan(agent, level.name, level.spec, self.level_plan(level, round_number),
                                       self.group_of(level), self.ladder(level, round_number)))
        return plan

    def ladder(self, level: Level, round_number: int) -> Adaptation | None:
        """The pool models nested in ``level``, by estimated training memory, largest first: the first that fits
        is the largest the agent can train (the pool's order by type is not one by memory: on a small CNN
        ``S1 (0.4, 3)`` needs more than ``M3 (0.66, 1)``)."""
        below = sorted((other for other in self.levels
                        if other is not level and self.family.is_nested(other.spec, level.spec)),
                       key=lambda other: self.cost(other, round_number), reverse=True)
        if not below:
            return None
        return Adaptation("ladder", [Candidate(other.spec.to_dict(), self.level_plan(other, round_number))
                                     for other in below])

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """What a device with ``budget`` bytes trains when it is sent the full model: the first model of its
        ladder (largest memory first) that fits, as the device's own pruning picks (a smaller model sent trains
        as it is, when it fits)."""
        top = self.levels[0]
        ladder = self.ladder(top, 1)
        order = [top] + [level for candidate in (ladder.candidates if ladder else [])
                         for level in self.levels if level.spec.to_dict() == candidate.spec]
        for level in order:
            if self.cost(level) <= budget:
                return {"trains": level.name, "spec": level.spec.describe(), "train_bytes": self.cost(level)}
        return self.nothing_fits(min(self.cost(level) for level in self.levels))

    def setting_to_shrink(self) -> str:
        depth = min(self.full_layers)
        if self.settings.widths == "auto":
            return (f"fewer whole layers (now I >= {depth}; e.g. adaptivefl.full_layers [2, 1, 0] with "
                    f"min_full_layers 0, a deviation: the paper keeps the shallow layers whole): with the others at "
                    f"width 0.01 the smallest model still needs {self.smallest_need(0.01) / 2**20:.1f} MiB")
        return (f"a smaller last width in adaptivefl.widths (now {self.widths[-1]:g}) or fewer whole layers "
                f"(adaptivefl.full_layers / min_full_layers, now I >= {depth})")

    def observe(self, round_number: int, outcomes: Sequence[TaskOutcome]) -> None:
        """Algorithm 1, lines 12-26: learn from what each task sent back (see :mod:`coordinator.client_selection`)."""
        by_spec = {level.spec: level.name for level in self.levels}
        for outcome in outcomes:
            task = outcome.task
            if outcome.status is TaskStatus.OK:
                self.tables.record(task.agent_id, task.level, task.level)
            elif outcome.status is TaskStatus.ADAPTED:
                # An update that trained no pool model (not one this strategy offered) teaches nothing of its size.
                returned = by_spec.get(outcome.spec_trained) if outcome.spec_trained is not None else None
                self.tables.record(task.agent_id, task.level, returned)
            elif outcome.status is TaskStatus.DECLINED and (outcome.reason or "").startswith(MEMORY_DECLINE_REASON):
                ladder = task.adaptation.candidates if task.adaptation is not None else ()
                smallest = by_spec.get(SubmodelSpec.from_dict(ladder[-1].spec)) if ladder else task.level
                self.tables.record(task.agent_id, task.level, None, declined_from=smallest or task.level)
            elif outcome.status is TaskStatus.FAILED and (outcome.reason or "").startswith(MEMORY_KILL_REASON):
                # Killed for memory training what it tried: nothing from that model upwards fits.
                tried = by_spec.get(outcome.spec_tried) if outcome.spec_tried is not None else None
                self.tables.record(task.agent_id, task.level, None, declined_from=tried or task.level)
            else:  # declined or failed for another reason, rejected, missing: a selection, nothing learnt of memory
                self.tables.record(task.agent_id, task.level, None)

    def weight(self, result: TaskResult) -> float:
        """Algorithm 2 weights every update by its local data size."""
        return float(max(1, result.num_samples))

    # ------------------------------------------------------------------ reading
    def describe(self) -> list[dict[str, Any]]:
        """Per pool model: the level rows, its type, r_w and I, its share of the full model's parameters and the
        ladder an agent given it may fall down."""
        rows = super().describe()
        by_name = {level.name: level for level in self.levels}
        by_spec = {level.spec: level.name for level in self.levels}
        full = self.family.param_count()
        for row in rows:
            level = by_name[row["name"]]
            row["params_share"] = round(self.family.param_count(level.spec) / full, 4)
            ladder = self.ladder(level, self.config.rounds)
            row["ladder"] = [by_spec.get(SubmodelSpec.from_dict(candidate.spec), "?")
                             for candidate in (ladder.candidates if ladder else [])]
        return rows

    def setup_summary(self) -> dict[str, Any]:
        """The selection mode, the values of I, p, the re-admission rounds K (0: never) and the L type's divisor
        (``fedfit plan`` shows them)."""
        return {"selection": self.settings.selection, "full_layers": self.full_layers, "p": self.per_type,
                "readmit_after": self.tables.readmit_after,  # 0: never (the paper's rule)
                "large_divisor": self.settings.large_divisor}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "pool": [level.name for level in self.levels],
                "specs": [level.spec.to_dict() for level in self.levels], "tables": self.tables.state_dict(),
                **({"widths": list(self.fitted)} if self.fitted is not None else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if state.get("version") not in READABLE_VERSIONS or not isinstance(state.get("tables"), dict):
            raise ValueError(f"the checkpoint's AdaptiveFL state is not one this version reads (no tables of version "
                             f"{' or '.join(map(str, READABLE_VERSIONS))}, got version {state.get('version')!r})")
        if "widths" in state and self.settings.widths != "auto":
            raise ValueError("the checkpoint's AdaptiveFL pool was sized to the fleet (adaptivefl.widths: auto); "
                             "resume with that setting, or use another state_dir")
        if "widths" in state:  # sized to the fleet: the same pool again
            self.fitted = [float(width) for width in state["widths"]]
            self._levels = None
            self.tables = self._new_tables()
        if state.get("specs") != [level.spec.to_dict() for level in self.levels]:
            raise ValueError("the checkpoint's AdaptiveFL tables were learnt for another pool (other model or "
                             "adaptivefl settings); use the settings they were made with, or another state_dir")
        self.tables.load_state_dict(state["tables"])
