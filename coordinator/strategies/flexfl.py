"""FlexFL (Chen et al., 2024): an APoZ-guided pool of nested sub-models, adaptive local pruning and small-to-large
self-distillation.

Pre-processing (once, at set-up; Alg. 2 lines 2-5): a proxy set is carved from the server's training data
(``flexfl.proxy_fraction`` of the training split, never the test split); the global model is pre-trained on its
training part (``proxy_train``) with the training-plan interpreter for ``pretrain_rounds`` rounds (one round: one
pass over that part; the paper trains "for 100 rounds", the default is shorter, see :class:`FlexFLConfig`), then
scored on the rest: APoZ per prunable layer (``apoz_at``: after the ReLUs, the paper's, or before the batch norms)
and the adjustment weights of Eq. 3 (:mod:`models.pruning`). Algorithm 1 prunes the model to every target ratio of
L_p (the pool P: ``M1`` (smallest) .. ``Mn`` (the full model)) in the unit ``size`` (default ``memory``: the
model-dependent part of the estimated training memory, the unit of the budgets devices report; ``params``: the
paper's), and M2..Mn to their adaptive variants ``Mi'`` by the same rule, "Gamma x size(M)" less, size(M) the
global model's (``adaptive_mode: global``; ``relative``: Gamma x the pool model's own); M1' only with
``full_variant`` (the paper has none). Smaller gammas give nested models, so the pool is a chain
``M1 < M2' < M2 < ... < Mn' < Mn``. The global model is then reset (the paper) or starts from the pre-trained
weights (``init: pretrained``). The scores, the pool and a summary of the pre-training are strategy state: saved
with the checkpoint and restored on resume without redoing them.

Rounds: ``fraction`` of the online agents; the coordinator sends each a model of P only (Alg. 2 line 8: "m in
P"): the largest pool model that fits the budget it last reported (Step 1: the coordinator's resource table), or,
when the largest thing that fits is an adaptive variant ``Mi'``, its pool model ``Mi``, which the device prunes
itself (AdaPrune). The ladder under a sent model is every smaller pool model and variant nested in it
(``M3 -> M3' -> M2 -> M2' -> M1``, the paper's order): an agent trains the largest rung that fits its memory now
and says which. A device training ``Mi`` (or ``Mi'``) distils from the smaller pool
models ``M1..M(i-1)`` nested in it, run from its current weights without gradient (Eq. 4: cross-entropy plus
``lambda/(i-1) * sum_j tau^2 KL(softmax(y_j / tau) || softmax(y_i / tau))``, one ``nested_kd`` term per teacher;
the KL averaged over the classes as the reference code's ``KLDivLoss()`` does, ``flexfl.kd_reduction: mean``, or
summed over them as the paper writes it, ``batchmean``).
Aggregation is masked and weighted by the samples each update trained on; every pool model is a slice of the one
global model, so all are refreshed by it. Every pool model is evaluated (``level_accuracy``) each round, or every
``data.levels_every`` rounds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from coordinator.evaluation import accuracies
from coordinator.levels import Level, affordable_share, fleet_shares
from coordinator.method_settings.flexfl import FLEXFL_RATIOS
from coordinator.strategies.base import State, StrategyContext, TaskResult
from coordinator.strategies.leveled import LevelStrategy
from models import SubmodelSpec
from models.pruning import adjustment_weights, apoz_scores, prune_to_ratio
from models.training import train
from protocol import LossTerm, TrainingPlan

__all__ = ["FlexFL"]

STATE_VERSION = 2  # 2: pre-training in rounds, apoz_at, full_variant


class FlexFL(LevelStrategy):
    """The APoZ-guided pool, dispatch by the resource table, adaptive pruning and self-KD (see the module
    docstring)."""

    name = "flexfl"

    def __init__(self, context: StrategyContext) -> None:
        self.settings = context.config.flexfl
        self._setup: dict[str, Any] | None = None
        self._pretrained: dict[str, torch.Tensor] | None = None
        super().__init__(context, lazy=True)

    # ------------------------------------------------------------------ pre-processing
    def fingerprint(self) -> dict[str, Any]:
        """What the pre-processing depends on: a restored state made with anything else is refused."""
        family = self.family
        return {"family": family.name, "options": {k: list(v) if isinstance(v, tuple) else v
                                                    for k, v in family.options.items()},
                "classes": family.num_classes, "in_channels": family.in_channels, "seed": self.config.seed,
                "input_size": list(self.context.input_size), "batch_size": self.config.recipe.batch_size,
                "settings": {k: v for k, v in asdict(self.settings).items()
                             if k not in ("kd_weight", "tau", "kd_reduction", "init")}}

    def setup(self) -> dict[str, Any]:
        """The pre-processing's result (made on first use unless restored): proxy sizes, pre-training summary,
        APoZ scores, adjustment weights and the pool."""
        if self._setup is None:
            self._setup = self._preprocess()
        return self._setup

    def _proxy(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        context, settings = self.context, self.settings
        if context.training_sample is None or context.training_size < 1:
            raise ValueError("FlexFL needs the server's training split for its proxy set, and none was given")
        count = max(4, round(settings.proxy_fraction * context.training_size))
        x, y = context.training_sample(count)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.config.seed))
        x, y = x[order], y[order]
        cut = min(len(x) - 2, max(2, round(settings.proxy_train * len(x))))
        return x[:cut], y[:cut], x[cut:], y[cut:]

    def _preprocess(self) -> dict[str, Any]:
        settings, family = self.settings, self.family
        train_x, train_y, score_x, score_y = self._proxy()
        torch.manual_seed(self.config.seed)
        model = family.build(track_bn_stats=False)
        summary: dict[str, Any] = {"train_samples": len(train_x), "score_samples": len(score_x),
                                   "rounds": settings.pretrain_rounds}
        if settings.pretrain_rounds > 0:
            # One round: one pass over the proxy training part (the optimizer's state carries over between rounds).
            plan = TrainingPlan(optimizer=self.recipe_plan().optimizer, epochs=settings.pretrain_rounds,
                                batch_size=min(self.config.recipe.batch_size, len(train_x)), seed=self.config.seed)
            result = train(model, SubmodelSpec.full(), train_x, train_y, plan,
                           labels=sorted(set(train_y.tolist())), num_classes=family.num_classes)
            summary.update(loss=round(result.loss, 4), steps=result.steps, seconds=round(result.seconds, 2))
        # Built without BN statistics, the model normalises with each batch's even in eval mode (dropout off).
        # (Batches of 1000, as always: with each batch's statistics, outputs depend on how the samples are batched.)
        summary["score_accuracy"] = round(accuracies(model, score_x, score_y, batch_size=1000)[-1], 4)
        self._pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        started = time.monotonic()
        apoz = apoz_scores(family, model, score_x, at=settings.apoz_at)
        weights = adjustment_weights(family)
        pool = self._pool(settings.fixed_ratios(), apoz, weights)
        summary["pool_seconds"] = round(time.monotonic() - started, 2)
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "pretraining": summary,
                "apoz": apoz, "adjustment": weights, "pool": pool}

    def _pool(self, ratios: Sequence[float], apoz: Mapping[str, float],
              weights: Mapping[str, float]) -> list[dict[str, Any]]:
        """Algorithm 1: the pool models of ``ratios`` (smallest first) and their adaptive variants, each variant only
        where its target lies between its pool model and the next smaller one."""
        settings = self.settings
        pool: list[dict[str, Any]] = []
        for number, ratio in enumerate(ratios, start=1):
            pool.append(self._prune(f"M{number}", ratio, apoz, weights, None))
            below = ratios[number - 2] if number > 1 else 0.0
            if settings.has_variant(number) and below < settings.adaptive_target(ratio) < ratio:
                pool.append(self._prune(f"M{number}'", settings.adaptive_target(ratio), apoz, weights,
                                        f"M{number}"))
        return pool

    # ------------------------------------------------------------------ sized to the fleet
    @property
    def by_fleet(self) -> bool:
        """Whether the pool is sized from the fleet's budgets: ``ratios: auto`` with ``size: memory``."""
        return self.settings.ratios == "auto" and self.settings.size == "memory"

    @property
    def awaits_fleet(self) -> bool:
        return self.by_fleet and "fitted" not in self.setup()

    def fit_to_fleet(self, budgets: Sequence[int]) -> str | None:
        """``ratios: auto``: one pool model per cluster of the devices' affordable shares of the full model's
        ``memory`` size (:func:`coordinator.levels.fleet_shares`), each a ``tolerance`` below its share; where a pool
        model then needs more than its cluster's weakest device has as it trains (its Eq. 4 teachers add to the
        plain size), its target shrinks by that much and the pool is made again (a few times at most). The APoZ
        scores and the pre-training are not redone."""
        if not self.by_fleet:
            return None
        setup = self.setup()
        tolerance = self.settings.tolerance
        if budgets and any(budget < self.cost(self.levels[0]) for budget in budgets):
            estimate = self.context.training_memory(SubmodelSpec.full(), self.recipe_plan())
            full = float(estimate.total - estimate.overhead)
            factor = self.context.device_factor
            share_of = {budget: affordable_share(budget, estimate.overhead, full, factor) for budget in budgets}
            clusters = fleet_shares(list(share_of.values()), most=len(FLEXFL_RATIOS) + 1)[:-1]
            # each cluster's weakest budget: the least budget whose share reaches the cluster's
            weakest = [min(b for b, share in share_of.items() if share >= cluster) for cluster in clusters]
            targets = [cluster - tolerance for cluster in clusters]
        else:  # nothing reported, or every device trains the full model: the fixed ratios
            targets, weakest = self.settings.fixed_ratios()[:-1], []
        dropped = 0
        for _ in range(4):
            kept = [(t, w) for t, w in itertools.zip_longest(targets, weakest) if t > tolerance]
            dropped += len(targets) - len(kept)
            targets, weakest = [t for t, _ in kept], [w for _, w in kept]
            pool, reached = self._reachable_pool([*targets, 1.0], setup)
            dropped += len(targets) + 1 - len(reached)
            weakest = [w for t, w in zip(targets, weakest) if t in reached]
            targets = reached[:-1]
            setup["pool"] = pool
            self._levels = None
            needs = {level.name: self.cost(level) for level in self.levels if self.sends(level)}
            over = [(index, needs[f"M{index + 1}"], budget) for index, budget in enumerate(weakest)
                    if budget is not None and needs.get(f"M{index + 1}", 0) > budget]
            if not over:
                break
            for index, need, budget in over:  # shrink by what the model needs beyond its devices' budget
                targets[index] *= affordable_share(budget, 0, need, 1.0)
        setup["fitted"] = [round(ratio, 6) for ratio in [*targets, 1.0]]
        _ = self.levels  # checked now (nested, one proportion per model sent)
        return (f"flexfl.ratios auto: pool models at {', '.join(f'{r:.3g}' for r in [*targets, 1.0])} of the full "
                f"model's training memory, from {len(budgets)} reported budget{'s' * (len(budgets) != 1)}"
                + (f" ({dropped} share{'s' * (dropped != 1)} no pruning reaches)" if dropped else ""))

    def _reachable_pool(self, ratios: list[float], setup: Mapping[str, Any]) -> tuple[list[dict[str, Any]],
                                                                                       list[float]]:
        """The pool of ``ratios``, leaving out the smallest ratios no gamma reaches within tolerance (their
        devices go unserved); with the ratios kept."""
        while True:
            try:
                return self._pool(ratios, setup["apoz"], setup["adjustment"]), ratios
            except ValueError:
                if len(ratios) == 1:
                    raise
                ratios = ratios[1:]

    def _prune(self, name: str, target: float, apoz: Mapping[str, float], weights: Mapping[str, float],
               variant_of: str | None) -> dict[str, Any]:
        settings = self.settings
        measure: Any = self.memory_size if settings.size == "memory" else settings.size
        try:
            pruned = prune_to_ratio(self.family, apoz, weights, target, step=settings.step,
                                    tolerance=settings.tolerance, rounding=settings.rounding, measure=measure,
                                    search=settings.search)
        except ValueError as exc:
            raise ValueError(f"FlexFL cannot make pool model {name}: {exc}") from None
        return {"name": name, "target": round(target, 6), "share": round(pruned.share, 6),
                "gamma": None if pruned.gamma == float("inf") else pruned.gamma,
                "keep": {k: round(v, 6) for k, v in pruned.ratios.items()}, "spec": pruned.spec.to_dict(),
                "adaptive_of": variant_of}

    def memory_size(self, spec: SubmodelSpec) -> float:
        """The ``memory`` size of a pool model: the model-dependent part of its estimated training memory with
        the recipe's plain cross-entropy (the runtime's fixed overhead, the same for every model, left out)."""
        estimate = self.context.training_memory(spec, self.recipe_plan())
        return float(estimate.total - estimate.overhead)

    # ------------------------------------------------------------------ levels
    def make_levels(self) -> list[Level]:
        pool = self.setup()["pool"]
        levels = [Level(entry["name"], self.family.validate_spec(SubmodelSpec.from_dict(entry["spec"])),
                        {"target": entry["target"], "share": entry["share"], "gamma": entry["gamma"],
                         "adaptive_of": entry["adaptive_of"], "keep": entry["keep"]})
                  for entry in pool]
        levels.sort(key=lambda level: self.family.param_count(level.spec), reverse=True)
        specs = [level.spec for level in levels]
        if len(set(specs)) != len(specs):
            raise ValueError("FlexFL's pool holds two identical models: an adaptive variant fell on its pool model "
                             "(use a larger flexfl.adaptive_cut or a smaller flexfl.tolerance)")
        for larger, smaller in itertools.pairwise(levels):
            if not self.family.is_nested(smaller.spec, larger.spec):
                raise ValueError(f"FlexFL's pool is not nested: {smaller.name} does not lie inside {larger.name}")
        return levels

    def sends(self, level: Level) -> bool:
        """The coordinator sends the pool models P = {M1..Mn} only (Alg. 2 line 8); an adaptive variant is
        reached by the device's own pruning, down the ladder of the pool model it belongs to."""
        return level.info.get("adaptive_of") is None

    def setting_to_shrink(self) -> str:
        if self.by_fleet:
            return ("a larger memory budget, or fixed flexfl.ratios with a smaller first one (auto sized the pool to "
                    "the budgets the fleet reported at its first round)")
        return f"a smaller first ratio in flexfl.ratios (now {self.settings.fixed_ratios()[0]:g})"

    def plan_for_budget(self, budget: int) -> dict[str, Any]:
        """What a device reporting ``budget`` bytes trains; ``sent``: the pool model it is sent, when that is
        larger (it prunes it to the adaptive variant it trains)."""
        planned = super().plan_for_budget(budget)
        level = next((level for level in self.levels if level.name == planned.get("trains")), None)
        sent = self.sent_for(level) if level is not None else None
        if sent is not None and sent is not level:
            planned["sent"] = sent.name
        return planned

    def teachers(self, level: Level) -> list[Level]:
        """The pool models (not adaptive variants) smaller than ``level`` and nested in it: its Eq. 4 teachers."""
        own = level.info.get("adaptive_of") or level.name
        return [other for other in self.levels
                if other.info.get("adaptive_of") is None and other.name != own and other is not level
                and self.family.param_count(other.spec) < self.family.param_count(level.spec)
                and self.family.is_nested(other.spec, level.spec)]

    def level_plan(self, level: Level, round_number: int) -> TrainingPlan:
        """Cross-entropy plus Eq. 4's distillation from every smaller pool model nested in ``level``."""
        settings = self.settings
        teachers = self.teachers(level)
        terms = [LossTerm.ce(masked=self.masked_ce)]
        if teachers and settings.kd_weight > 0:
            weight = settings.kd_weight / len(teachers)
            if settings.kd_reduction == "mean":
                weight /= self.family.num_classes
            terms += [LossTerm.nested_kd(teacher.spec.to_dict(), weight=weight, tau=settings.tau)
                      for teacher in teachers[::-1]]
        return self.recipe_plan(terms)

    def weight(self, result: TaskResult) -> float:
        """FlexFL's aggregation weights every update by the samples it trained on."""
        return float(max(1, result.num_samples))

    def initial_states(self, seed: int) -> dict[str, State]:
        """A fresh global model (the paper), or the pre-trained one (``init: pretrained``). The pre-processing runs
        here, at set-up, unless a checkpoint's state restored it (then the checkpoint's weights follow)."""
        states = super().initial_states(seed)
        self.setup()
        _ = self.levels  # the pool is checked (nested, one proportion per model) at set-up, not in round 1
        if self.settings.init == "pretrained" and self._pretrained is not None:
            for group in states:
                states[group].update({k: v.clone() for k, v in self._pretrained.items() if k in states[group]})
        return states

    def describe(self) -> list[dict[str, Any]]:
        """Per pool model: the level rows (``target`` and ``share`` in the unit of ``flexfl.size``), its share of
        the full model's parameters, whether the coordinator sends it (P) or it is an adaptive variant, its Eq. 4
        teachers and the ladder an agent given it may fall down."""
        rows = super().describe()
        by_name = {level.name: level for level in self.levels}
        by_spec = {level.spec: level.name for level in self.levels}
        for row in rows:
            level = by_name[row["name"]]
            row["params_share"] = round(self.family.param_count(level.spec) / self.family.param_count(), 4)
            row["sent"] = self.sends(level)  # False: an adaptive variant, reached only down a ladder
            row["teachers"] = [teacher.name for teacher in self.teachers(level)]
            ladder = self.ladder(level, self.config.rounds)
            row["ladder"] = [by_spec.get(SubmodelSpec.from_dict(candidate.spec), "?")
                             for candidate in (ladder.candidates if ladder else [])]
        return rows

    def size_unit(self) -> str:
        """In words, the unit the pool's ``target`` and ``share`` are shares of (``flexfl.size``)."""
        return {"memory": "memory (the model-dependent part of each model's estimated training memory at batch "
                          f"{self.config.recipe.batch_size}, the unit of the budgets devices report)",
                "params": "params (all parameters, the paper's unit)",
                "features": "features (all parameters but the final classifier's, the reference code's)",
                }[self.settings.size]

    def setup_summary(self) -> dict[str, Any]:
        """The unit the pool is sized in, the pre-training summary, the APoZ scores (and where they were read) and
        the adjustment weights (``fedfit plan`` shows them)."""
        setup = self.setup()
        return {"pool_size": self.size_unit(), "adaptive_cut": self.adaptive_text(),
                "pretraining": setup["pretraining"], "apoz_at": self.settings.apoz_at,
                **{key: {k: round(v, 4) for k, v in setup[key].items()} for key in ("apoz", "adjustment")}}

    def adaptive_text(self) -> str:
        """In words, how the adaptive variants are cut (``flexfl.adaptive_cut``, ``adaptive_mode``)."""
        settings = self.settings
        if settings.adaptive_cut <= 0:
            return "none (adaptive_cut 0)"
        rule = "of the full model's size (global, the paper)" if settings.adaptive_mode == "global" else \
            "of each pool model's own size (relative)"
        return f"{settings.adaptive_cut:g} {rule}" + (", M1' included" if settings.full_variant else "")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"setup": self.setup()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        setup = state.get("setup")
        if not isinstance(setup, dict) or setup.get("version") != STATE_VERSION:
            raise ValueError("the checkpoint's FlexFL state is not one this version reads (no setup of version "
                             f"{STATE_VERSION})")
        if setup.get("fingerprint") != self.fingerprint():
            raise ValueError("the checkpoint's FlexFL pool was made for another model or other flexfl settings; "
                             "use the settings it was made with, or another state_dir")
        self._setup = setup
        self._pretrained = None
        self._levels = None
