"""Who a method serves, said before its rounds: per memory budget (a tier of devices), what the strategy would hand
a device with it, by the device's own rule (:meth:`~coordinator.strategies.Strategy.plan_for_budget`), and for a
budget that can train nothing, the least it would need and the setting that would make the method's smallest
option smaller.

The simulator states it per tier at the start of a run and keeps it in the report; the coordinator logs it per
device from the budget it reports, again when that changes what it can train (:class:`ServiceLog`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.registry import AgentRecord
from coordinator.strategies import Strategy

__all__ = ["ServiceLog", "TierService", "answer_text", "bytes_text", "serve_tiers", "service_lines", "unserved_text"]


@dataclass(frozen=True)
class TierService:
    """What a method would hand the devices of one tier: its name, its budget, how many devices it has (0: not
    known), and :meth:`~coordinator.strategies.Strategy.plan_for_budget`'s answer."""

    tier: str
    budget: int
    devices: int
    answer: dict[str, Any]

    @property
    def served(self) -> bool:
        """Whether a device of this tier trains something."""
        return self.answer.get("trains") != "nothing" and self.answer.get("fits") is not False

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "budget_bytes": self.budget, "devices": self.devices, "served": self.served,
                **self.answer}


def bytes_text(value: float) -> str:
    """Bytes in KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 2**10:.1f} KiB"


def _fractions(text: str) -> str:
    """``width=0.166667`` (a spec's six digits) as ``width=1/6``: widths as the scenarios write them."""
    def simpler(match: re.Match[str]) -> str:
        value = float(match.group(1))
        for denominator in (2, 3, 4, 6, 8, 16):
            if 0 < value < 1 and abs(value * denominator - round(value * denominator)) < 1e-4:
                return f"width={round(value * denominator)}/{denominator}"
        return match.group(0)

    return re.sub(r"width=([0-9.]+)", simpler, text)


def answer_text(answer: dict[str, Any]) -> str:
    """What one method hands a budget, in a few words (``e (width=1/16)``, ``depth-wise 0 | 1-3``,
    ``nothing``)."""
    parts = [_fractions(str(answer.get("trains", "-")))]
    if "segments" in answer:
        parts.append(answer["segments"])
    elif answer.get("spec") and answer.get("spec") != answer.get("trains"):
        parts.append(f"({_fractions(answer['spec'])})")
    if answer.get("sent") and answer.get("sent") != answer.get("trains"):
        parts.append(f"pruned from {answer['sent']}")
    if answer.get("fits") is False:
        parts.append("[does not fit]")
    return " ".join(parts)


def serve_tiers(strategy: Strategy, tiers: Sequence[tuple[str, int, int]]) -> list[TierService]:
    """Per ``(tier name, budget bytes, devices)``: what the strategy hands a device of it."""
    return [TierService(name, budget, devices, strategy.plan_for_budget(budget)) for name, budget, devices in tiers]


def unserved_text(service: TierService) -> str:
    """Why a tier trains nothing and what would change it, one sentence."""
    needs = service.answer.get("needs_bytes")
    count = f"{service.devices} device{'s' * (service.devices != 1)}, " if service.devices else ""
    text = f"tier {service.tier} ({count}{bytes_text(service.budget)}) can train nothing"
    if needs is not None:
        text += f": the smallest needs {bytes_text(needs)}"
    if service.answer.get("to_fit"):
        text += f"; to serve it: {service.answer['to_fit']}"
    return text


def largest_unserved(method: str, services: Sequence[TierService], largest: str | None,
                     needs: int | None = None) -> str | None:
    """The line saying that no tier trains the method's ``largest`` model (which ``needs`` bytes to train), with
    what the strongest tier has; None when some tier trains it (or the method has none)."""
    if largest is None or not services or any(s.answer.get("trains") == largest for s in services):
        return None
    strongest = max(services, key=lambda s: s.budget)
    figures = (f", which needs {bytes_text(needs)} to train; the strongest tier, {strongest.tier}, has "
               f"{bytes_text(strongest.budget)}" if needs is not None else "")
    return f"{method}: no tier trains its largest model ({largest}{figures}): the parts only it holds learn from no device"


def largest_needs(strategy: Strategy) -> int | None:
    """The training memory of the largest model ``strategy`` hands out (what an unbounded budget is handed)."""
    needs = strategy.plan_for_budget(1 << 62).get("train_bytes")
    return int(needs) if needs is not None else None


def service_lines(method: str, services: Sequence[TierService], largest: str | None = None,
                  needs: int | None = None) -> list[str]:
    """The start-of-run statement: one line per tier, then one per tier that trains nothing, and one where no tier
    trains the method's ``largest`` model (whose deepest parts then learn from no device; ``needs``: its training
    memory)."""
    served = sum(s.devices for s in services if s.served)
    total = sum(s.devices for s in services)
    lines = [f"{method} serves {served} of {total} devices: "
             + "; ".join(f"{s.tier} ({bytes_text(s.budget)}) -> {answer_text(s.answer)}" for s in services)]
    lines += [f"{method}: {unserved_text(s)}" for s in services if not s.served]
    if (line := largest_unserved(method, services, largest, needs)) is not None:
        lines.append(line)
    return lines


class ServiceLog:
    """Whether the method can serve each device, by the budget it reports: told once per device, and again
    whenever that changes (a fluctuating budget that crosses the method's smallest need)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self._served: dict[str, bool] = {}
        self._answers: dict[int, dict[str, Any]] = {}  # per budget: a fleet reports few distinct ones

    def changes(self, agents: Sequence[AgentRecord]) -> list[tuple[str, TierService]]:
        """``(agent id, what the method hands it)`` for every agent with a budget whose answer is new."""
        found = []
        for agent in agents:
            budget = agent.budget()
            if budget is None:
                continue
            if budget not in self._answers:
                self._answers[budget] = self.strategy.plan_for_budget(budget)
            service = TierService(agent.capabilities.device_kind if agent.capabilities else "?", budget, 1,
                                  self._answers[budget])
            if self._served.get(agent.agent_id) != service.served:
                self._served[agent.agent_id] = service.served
                found.append((agent.agent_id, service))
        return found
