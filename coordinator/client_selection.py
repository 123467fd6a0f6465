"""AdaptiveFL's client selection (Algorithm 1): a curiosity table and a resource table per client, learnt from
what each client sends back, never from the resources it reports.

The pool ``R = [S_p, ..., S_1, M_p, ..., M_1, L_1]`` is listed smallest first (see below); every model has a type (its level:
S, M, L). Per client, the curiosity table ``T_c[type]`` counts how often the client was given or gave back a model
of that type and the resource table ``T_r[model]`` holds training scores; both start at 1.

- **Resource reward** ``R_s(type, c)``: for each model ``k`` of the type, the share of the client's scores that
  lie on ``k`` or larger models, summed over the type's models and divided by ``p`` (the models per type). The L
  type has one model: ``large_divisor="paper"`` (the default) divides its share by ``p`` too, as the paper's
  formula writes it for every type; ``"reference"`` divides it by 1, as the reference code does (the type's model
  count). The S and M types have ``p`` models: both options agree there. For L the divisor scales every client's
  ``R_s`` alike, so it moves the draw only through the cap: under ``"reference"`` every client with more than half
  its scores on L is capped alike and curiosity alone ranks them; under ``"paper"`` (``p >= 2``) ``R_s(L) <= 1/p``
  never reaches the cap and a client's L share weighs its draw.
- **Curiosity reward** ``R_c(type, c) = 1 / sqrt(T_c[type][c])`` (MBIE-EB).
- **Reward** ``R = min(cap, R_s) * R_c`` (cap 0.5: beyond a 50% success rate curiosity decides); a client is
  drawn for a model with probability ``R / sum R`` among the clients not yet given a model this round; a client
  whose reward is 0 is never drawn.
- **Update** after a client given ``m`` returns ``m'``: ``T_c[type(m)] += 1`` and ``T_c[type(m')] += 1``; if
  ``m' == m`` every score from ``m`` up to ``L_1`` gains 1 and ``L_1`` gains ``p - 1`` more; if the client pruned,
  ``T_r[m'] += p`` and the scores from ``m'`` upwards lose ``tau = 0, 1, 2, ...`` (floored at 0).
- **Nothing came back for memory** (the client declined: not even the smallest model nested in ``m`` fit; or its
  training was killed for memory), a case the paper's simulated clients never meet: the scores from that smallest
  model (the one killed) upwards lose ``tau = 1, 2, ...``. Any other ending (declined or failed for another reason,
  rejected, missed its deadline) counts as a selection only (``T_c[type(m)] += 1``).
- **Re-admission** (not in the paper; ``readmit_after = K``, default 5): a client whose every score has fallen to 0
  has reward 0 for every model in the modes that weigh rewards (``rl``, ``resource``), so under the paper's rule it
  is never drawn again: not only a device that cannot train the smallest model, but also one whose first task met
  a passing shortage (its scores were still 1, and a decline from the smallest model takes them all to 0). With
  ``K > 0``, :meth:`SelectionTables.readmit`, called at the start of every round, notes the first round it finds
  such a client out, and once ``K`` rounds have passed resets its resource table to the paper's initial 1s
  (Algorithm 1, line 2); its curiosity counts stay (they count real selections and are never 0). A client that
  declines in round ``r`` is out in rounds ``r + 1 .. r + K`` and has a positive reward for every model in round
  ``r + K + 1``: no client is kept out of the draws for more than ``K`` rounds. ``K = 0`` (or None) keeps the
  paper's strict rule. A client whose scores fell to 0 for its larger models only is not out (it is drawn for
  smaller ones, and a whole return raises the larger scores again, as in the paper), and is left alone.

  Why a reset after ``K`` rounds and not a curiosity floor (a least reward every client keeps): a floor changes
  every client's odds in every draw, and would send the next task to a device that declined the round before; the
  reset leaves Algorithm 1 untouched for every client the tables still rate, and forgets only evidence that is
  ``K`` rounds old, the age at which the paper's premise (resources that fluctuate) makes it stale. The returning
  client is rated as a new one: a device that recovered is found again by the paper's own updates, and one that
  still cannot train costs at most one declined task per ``K + 1`` rounds.

``R`` is the paper's order: by type, then by ``I``. It is the order by size on VGG-16, not on every family (on a
4-layer CNN ``S1 (0.4, 3)`` holds more parameters than ``M3 (0.66, 1)``); "larger" below means later in ``R``.

Ablations (the paper's Sec. 4.4): ``curiosity`` draws by ``R_c`` alone, ``resource`` by ``R_s`` alone,
``random`` draws the client uniformly, ``greedy`` sends the largest model to uniformly drawn clients.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LARGE_DIVISORS", "SELECTION_MODES", "PoolEntry", "SelectionTables"]

SELECTION_MODES = ("rl", "greedy", "random", "curiosity", "resource")
#: How ``R_s`` divides the L type's share: by p (the paper's formula) or by its one model (the reference code).
LARGE_DIVISORS = ("paper", "reference")


@dataclass(frozen=True)
class PoolEntry:
    """A pool model as the tables see it: its name and its type (level)."""

    name: str
    type: str


class SelectionTables:
    """The curiosity and resource tables of every client, and the draws they drive (see the module docstring).

    ``pool`` lists the models smallest first (the paper's R); ``per_type`` is p, the models per level below L;
    ``large_divisor`` is ``"paper"`` or ``"reference"``; ``readmit_after`` is K, the rounds a client whose scores
    all fell to 0 stays out (0 or None: for good, the paper's rule)."""

    def __init__(self, pool: Sequence[PoolEntry], per_type: int, *, cap: float = 0.5,
                 large_divisor: str = "paper", readmit_after: int | None = 5) -> None:
        if not pool:
            raise ValueError("client selection needs a pool of at least one model")
        if large_divisor not in LARGE_DIVISORS:
            raise ValueError(f"large_divisor must be one of {', '.join(LARGE_DIVISORS)}, got {large_divisor!r}")
        if readmit_after is not None and readmit_after < 0:
            raise ValueError(f"readmit_after must be a non-negative number of rounds or None, got {readmit_after}")
        names = [entry.name for entry in pool]
        if len(set(names)) != len(names):
            raise ValueError(f"pool model names must be distinct, got {names}")
        self.names = names
        self.types = list(dict.fromkeys(entry.type for entry in pool))
        self.type_of = {entry.name: entry.type for entry in pool}
        self.rank = {name: index for index, name in enumerate(names)}
        self.per_type = per_type
        self.cap = cap
        self.large_divisor = large_divisor
        self.readmit_after = readmit_after or 0
        self.curiosity: dict[str, dict[str, float]] = {}
        self.resource: dict[str, dict[str, float]] = {}
        #: Per client whose every score is 0: the first round :meth:`readmit` found it so.
        self.out_since: dict[str, int] = {}

    # ------------------------------------------------------------------ tables
    def _ensure(self, client: str) -> None:
        if client not in self.curiosity:
            self.curiosity[client] = dict.fromkeys(self.types, 1.0)
            self.resource[client] = dict.fromkeys(self.names, 1.0)

    def resource_reward(self, client: str, model_type: str) -> float:
        """``R_s``: the client's share of scores on each model of ``model_type`` or larger, summed over them and
        divided by p (``large_divisor="reference"``: by the type's model count, 1 for L)."""
        self._ensure(client)
        scores = [self.resource[client][name] for name in self.names]
        total = sum(scores)
        if total <= 0:
            return 0.0
        ranks = [index for index, name in enumerate(self.names) if self.type_of[name] == model_type]
        divisor = self.per_type if self.large_divisor == "paper" else len(ranks)
        return sum(sum(scores[rank:]) for rank in ranks) / (divisor * total)

    def is_out(self, client: str) -> bool:
        """Whether every score of ``client`` is 0: reward 0 for every model in the modes that weigh rewards."""
        return client in self.resource and sum(self.resource[client].values()) <= 0

    def readmit(self, round_number: int) -> list[str]:
        """At the start of round ``round_number``: note the clients newly found out (every score 0), and reset to
        the initial 1s the resource table of every client out for ``readmit_after`` rounds (none when it is 0).
        Returns the clients re-admitted. Idempotent within a round; rounds are the coordinator's numbers, so a
        resumed run counts on from the checkpoint."""
        back: list[str] = []
        for client in sorted(self.resource):
            if not self.is_out(client):
                self.out_since.pop(client, None)
                continue
            since = self.out_since.setdefault(client, round_number)
            if since > round_number:  # a clock that went back (not the coordinator's): count from now
                since = self.out_since[client] = round_number
            if self.readmit_after and round_number - since >= self.readmit_after:
                self.resource[client] = dict.fromkeys(self.names, 1.0)
                del self.out_since[client]
                back.append(client)
        return back

    def curiosity_reward(self, client: str, model_type: str) -> float:
        """``R_c = 1 / sqrt(T_c[type][client])``."""
        self._ensure(client)
        return 1.0 / math.sqrt(self.curiosity[client][model_type])

    def reward(self, client: str, model_type: str, mode: str = "rl") -> float:
        """The reward that weighs ``client``'s draw for a model of ``model_type`` under ``mode``."""
        if mode == "rl":
            return min(self.cap, self.resource_reward(client, model_type)) * self.curiosity_reward(client, model_type)
        if mode == "curiosity":
            return self.curiosity_reward(client, model_type)
        if mode == "resource":
            return self.resource_reward(client, model_type)
        if mode in ("random", "greedy"):
            return 1.0
        raise ValueError(f"selection mode must be one of {', '.join(SELECTION_MODES)}, got {mode!r}")

    def probabilities(self, model: str, clients: Sequence[str], mode: str = "rl") -> dict[str, float]:
        """Each client's probability of being drawn for ``model`` among ``clients`` (all 0 when no reward is
        positive)."""
        rewards = {client: self.reward(client, self.type_of[model], mode) for client in clients}
        total = sum(rewards.values())
        return {client: (value / total if total > 0 else 0.0) for client, value in rewards.items()}

    # ------------------------------------------------------------------ a round's draws
    def assign(self, count: int, clients: Sequence[str], rng: random.Random, mode: str = "rl") -> list[tuple[str, str]]:
        """``count`` (model, client) pairs for a round, each client at most once: a model drawn uniformly from the
        pool (``greedy``: the largest), then a client by :meth:`probabilities`. A model no remaining client has a
        positive reward for is drawn again among the models some client has; fewer pairs when none is left."""
        if mode not in SELECTION_MODES:
            raise ValueError(f"selection mode must be one of {', '.join(SELECTION_MODES)}, got {mode!r}")
        remaining = sorted(clients)
        pairs: list[tuple[str, str]] = []
        for _ in range(min(count, len(remaining))):
            model = self.names[-1] if mode == "greedy" else rng.choice(self.names)
            chances = self.probabilities(model, remaining, mode)
            if not any(chances.values()):
                open_models = [name for name in self.names
                               if any(self.reward(client, self.type_of[name], mode) > 0 for client in remaining)]
                if not open_models:
                    break
                model = rng.choice(open_models)
                chances = self.probabilities(model, remaining, mode)
            client = rng.choices(remaining, weights=[chances[c] for c in remaining], k=1)[0]
            remaining.remove(client)
            pairs.append((model, client))
        return pairs

    # ------------------------------------------------------------------ learning from returns
    def record(self, client: str, sent: str, returned: str | None, *, declined_from: str | None = None) -> None:
        """Update the tables after ``client`` was given ``sent`` and sent back ``returned`` (None: nothing).
        ``declined_from``: when nothing came back because no model fit, the smallest one it tried."""
        self._check(sent, returned, declined_from)
        self._ensure(client)
        counts, scores = self.curiosity[client], self.resource[client]
        counts[self.type_of[sent]] += 1
        if returned is not None:
            counts[self.type_of[returned]] += 1
        if returned == sent:
            for name in self.names[self.rank[sent]:]:
                scores[name] += 1
            scores[self.names[-1]] += self.per_type - 1
        elif returned is not None:
            scores[returned] += self.per_type
            self._penalise(scores, self.rank[returned], start=0)
        elif declined_from is not None:
            self._penalise(scores, self.rank[declined_from], start=1)

    def _check(self, *names: str | None) -> None:
        for name in names:
            if name is not None and name not in self.rank:
                raise ValueError(f"{name!r} is not a pool model ({', '.join(self.names)})")

    def _penalise(self, scores: dict[str, float], first: int, *, start: int) -> None:
        for tau, name in enumerate(self.names[first:], start=start):
            scores[name] = max(scores[name] - tau, 0.0)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The tables, JSON-able: ``{"curiosity": {client: {type: n}}, "resource": {client: {model: score}},
        "out_since": {client: round}}`` (``out_since``: the clients out, and since when, for re-admission)."""
        return {"curiosity": {c: dict(row) for c, row in self.curiosity.items()},
                "resource": {c: dict(row) for c, row in self.resource.items()},
                "out_since": dict(self.out_since)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s tables; ValueError when they name other types or models. Tables saved
        before re-admission (no ``out_since``) load with no client out yet: :meth:`readmit` counts those it finds
        out from the next round."""
        curiosity, resource = state.get("curiosity"), state.get("resource")
        out_since = state.get("out_since", {})
        if not isinstance(curiosity, dict) or not isinstance(resource, dict) or set(curiosity) != set(resource):
            raise ValueError("the selection tables hold no curiosity and resource table for the same clients")
        for client in curiosity:
            if set(curiosity[client]) != set(self.types) or set(resource[client]) != set(self.names):
                raise ValueError(f"the selection tables of {client!r} name other model types or pool models than "
                                 f"this pool's ({', '.join(self.names)})")
        if (not isinstance(out_since, dict) or not set(out_since) <= set(resource)
                or any(isinstance(r, bool) or not isinstance(r, int) for r in out_since.values())):
            raise ValueError("the selection tables' out_since must map clients of the tables to round numbers")
        self.curiosity = {c: {t: float(v) for t, v in row.items()} for c, row in curiosity.items()}
        self.resource = {c: {m: float(v) for m, v in row.items()} for c, row in resource.items()}
        self.out_since = dict(out_since)
