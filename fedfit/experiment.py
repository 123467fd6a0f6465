"""Experiment files: one YAML per claim, run by ``fedfit compare --config FILE``.

An experiment file is a coordinator configuration (model, data, recipe, rounds, method settings...) with one more
section, ``experiment``, holding what a comparison adds: which methods and baselines run, on which seeds, and the
fleet (agents, partition, budgets...) that ``fedfit compare`` otherwise takes from flags. A flag given on the
command line still wins over the file. The claim and the paper's figures ride along into the comparison's outputs,
so a result is never read apart from what it tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from common.config import ConfigError, from_mapping
from fedfit.sim.budgets import scenario_tiers
from fedfit.sim.speeds import parse_speeds, speeds_text

#: The top-level key of an experiment file that is not the coordinator's.
SECTION = "experiment"
#: What ``--baseline`` adds: FedAvg on the full model with no budgets (every device trains it: the upper bound), and
#: FedAvg at the widest width the smallest tier can train (the lower bound every method must beat).
BASELINES = ("all-large", "all-small")


@dataclass(frozen=True)
class Experiment:
    """The ``experiment`` section of an experiment file (every key optional)."""

    claim: str = ""  # the paper's claim this experiment tests, in one sentence
    paper: str = ""  # the paper's own figures for it, as the paper states them
    algorithms: list[str] = field(default_factory=list)  # as --algorithms takes them
    baselines: list[str] = field(default_factory=list)  # of BASELINES
    seeds: list[int] = field(default_factory=list)  # empty: the one seed of --seed (or the configuration's)
    agents: int | None = None
    partition: str | None = None
    budgets: str | None = None
    budget_variance: float | None = None
    size_for: Literal["dip", "typical"] | None = None
    allocator: Literal["pooled", "compact", "default"] | None = None
    train_samples: int | None = None
    speeds: str | float | list[float] | None = None  # as --speeds takes them ("10,1"), or a list ([10, 1])

    def __post_init__(self) -> None:
        unknown = [name for name in self.baselines if name not in BASELINES]
        if unknown:
            raise ValueError(f"baselines {unknown} unknown: they are {', '.join(BASELINES)}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} name one more than once")
        if self.budgets is not None:
            scenario_tiers(self.budgets)  # its ValueError names the scenarios there are
        for name in ("agents", "train_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.budget_variance is not None and self.budget_variance < 0:
            raise ValueError(f"budget_variance must be non-negative, got {self.budget_variance}")
        if self.speeds is not None:
            try:
                self.speeds_text()
            except ValueError as exc:
                raise ValueError(str(exc).replace("--speeds", "speeds", 1)) from None

    def speeds_text(self) -> str | None:
        """``speeds`` as ``--speeds`` takes them (ValueError, one sentence, for a bad factor)."""
        if self.speeds is None:
            return None
        listed = self.speeds if isinstance(self.speeds, list) else [self.speeds]
        text = ",".join(str(factor) for factor in listed)
        return speeds_text(parse_speeds(text))

    def settings(self) -> dict[str, Any]:
        """The fleet settings the file gives (by :data:`fedfit.run_command.SETTINGS` name)."""
        names = ("agents", "partition", "budgets", "budget_variance", "size_for", "allocator", "train_samples")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return {**given, **({"speeds": self.speeds_text()} if self.speeds is not None else {})}

    def describe(self) -> dict[str, str]:
        """What a comparison's outputs quote of it (the claim and the paper's figures, where given)."""
        return {key: value for key, value in (("claim", self.claim), ("paper", self.paper)) if value}


def split_experiment(mapping: dict[str, Any], where: str) -> tuple[dict[str, Any], Experiment | None]:
    """The coordinator's part of a configuration mapping and its ``experiment`` section, if any (ConfigError,
    naming ``where`` and the key, for a malformed one)."""
    if SECTION not in mapping:
        return mapping, None
    rest = {key: value for key, value in mapping.items() if key != SECTION}
    try:
        return rest, from_mapping(Experiment, mapping[SECTION], where=SECTION)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``: whole numbers, each once (ValueError otherwise)."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes whole numbers separated by commas, got {text!r}") from None
    if not seeds:
        raise ValueError(f"--seeds names no seed: {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds names one more than once: {text}")
    return seeds


def parse_baselines(text: str) -> list[str]:
    """``--baseline all-large,all-small``: names of :data:`BASELINES`, each once (ValueError otherwise)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in BASELINES]
    if unknown or not names:
        raise ValueError(f"--baseline takes {' and/or '.join(BASELINES)} (comma-separated), got {text!r}")
    return list(dict.fromkeys(names))
