"""What ``fedfit plan`` prints: one row per level or pool model, and with ``--budgets`` one row per device tier
saying what every method would hand it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from coordinator.serving import (
    TierService,
    answer_text,
    bytes_text,
    largest_needs,
    largest_unserved,
    unserved_text,
)

_FIRST = ("name", "tier", "budget_bytes", "trains", "segments", "spec", "params", "macs", "train_bytes")


def count_text(value: float) -> str:
    """A count in the unit that reads best: ``812``, ``61.5 K``, ``1.73 M``, ``2.5 G``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:g}"


def _cell(key: str, value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_cell(key, item) for item in value)
    if key.endswith("_bytes"):
        return bytes_text(value)
    if key in ("params", "macs"):
        return count_text(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _align(table: list[list[str]], left: Sequence[int]) -> str:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_plan(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns: name (or tier), spec, parameters, multiply-accumulates per sample, training memory, then
    the strategy's own figures."""
    keys = [k for k in _FIRST if any(k in row for row in rows)]
    keys += [k for row in rows for k in row if k not in keys and not isinstance(row[k], dict)]
    keys = list(dict.fromkeys(keys))
    table = [keys] + [[_cell(k, row[k]) if k in row else "-" for k in keys] for row in rows]
    return _align(table, left=(1,))


def format_setup(setup: dict[str, Any]) -> str:
    """A strategy's set-up summary, one line per entry (a mapping's items on its line)."""
    lines = []
    for key, value in setup.items():
        if isinstance(value, dict):
            value = " ".join(f"{k}={_cell(k, v)}" for k, v in value.items())
        lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def scenario_budgets(config: Any, dataset: Any, scenario: str, device: str = "cpu",
                     size_for: str = "dip") -> list[tuple[str, int]]:
    """Each tier of ``scenario`` with its budget as ``fedfit sim`` gives it (the same for every method; a
    fluctuating tier's in all but its rarest rounds, or ``size_for`` ``typical`` its median one, at the default
    variance)."""
    return _anchored_budgets(config, dataset, scenario, device, size_for)[2]


def _anchored_budgets(config: Any, dataset: Any, scenario: str, device: str,
                      size_for: str = "dip") -> tuple[Any, Any, list[tuple[str, int]]]:
    """The model family, the scenario's budget anchor, and :func:`scenario_budgets`."""
    from coordinator.planning import model_options
    from coordinator.strategies.base import base_plan
    from fedfit.sim.budgets import BudgetAnchor, dependable_bytes, scenario_tiers, scenario_variance
    from models import get_family

    family = get_family(config.model.family, dataset.num_classes, dataset.in_channels, **model_options(config))
    anchor = BudgetAnchor.estimate(family, base_plan(config.recipe), input_size=dataset.image_size, device=device)
    variance = scenario_variance(scenario)
    return family, anchor, [(tier.name, dependable_bytes(anchor, tier, variance, size_for))
                            for tier in scenario_tiers(scenario)]


def tier_rows(config: Any, dataset: Any, scenario: str, *, fedavg_width_set: bool = False,
              device: str = "cpu", size_for: str = "dip") -> list[dict[str, Any]]:
    """For every tier of ``scenario``: its name, its budget as ``fedfit sim`` gives it (the same for every method;
    ``size_for`` as :func:`scenario_budgets`)
    and what each method would hand it (FedAvg at the widest width the scenario's weakest devices can train,
    unless ``fedavg.width`` is set, as ``fedfit compare`` runs it); ``largest``: each method's largest model and
    its training memory (the same in every row)."""
    from coordinator.planning import model_options, strategy_for
    from coordinator.strategies import ALGORITHM_NAMES
    from fedfit.sim.budgets import width_for_all

    family, anchor, budgets = _anchored_budgets(config, dataset, scenario, device, size_for)
    strategies = {}
    for name in ALGORITHM_NAMES:
        method = replace(config, algorithm=name)
        if name == "fedavg" and not fedavg_width_set:
            width = width_for_all(scenario, anchor, config.levels)
            method = replace(method, fedavg=replace(config.fedavg, width=width))
        # (a method whose paper sets other model options, DepthFL's heads, gets the family they make)
        strategies[name] = strategy_for(method, dataset,
                                        family if model_options(method) == model_options(config) else None)
        strategies[name].fit_to_fleet([budget for _, budget in budgets])
    largest = {method: {"name": strategy.largest_whole_model(), "train_bytes": largest_needs(strategy)}
               for method, strategy in strategies.items()}
    return [{"tier": name, "budget_bytes": budget,
             "methods": {method: strategy.plan_for_budget(budget) for method, strategy in strategies.items()},
             "largest": largest}
            for name, budget in budgets]


def format_tiers(rows: Sequence[dict[str, Any]]) -> str:
    """One line per tier: its budget and, per method, what it would be handed."""
    if not rows:
        return ""
    methods = list(rows[0]["methods"])
    table = [["tier", "budget", *methods]]
    table += [[row["tier"], bytes_text(row["budget_bytes"]), *(answer_text(row["methods"][name]) for name in methods)]
              for row in rows]
    unserved = [f"{name}: {unserved_text(TierService(row['tier'], row['budget_bytes'], 0, row['methods'][name]))}"
                for name in methods for row in rows
                if not TierService(row["tier"], row["budget_bytes"], 0, row["methods"][name]).served]
    services = {name: [TierService(row["tier"], row["budget_bytes"], 0, row["methods"][name]) for row in rows]
                for name in methods}
    untrained = [line for name in methods if "largest" in rows[0] and (line := largest_unserved(
        name, services[name], rows[0]["largest"][name]["name"], rows[0]["largest"][name]["train_bytes"]))]
    notes = ["", ("Each method's answer is what a device of that budget then trains: the agent's own check (its "
                  "initial calibration margin included)."), *unserved, *untrained]
    return "\n".join([_align(table, left=range(2, 2 + len(methods))), *notes])
