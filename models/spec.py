"""Sub-model specifications: what one client trains.

A :class:`SubmodelSpec` is plain data. It travels inside a task message (``to_dict`` / ``from_dict`` use
msgpack-friendly primitives only) and is interpreted by a :class:`models.family.ModelFamily`, which knows
the layer names, the body blocks and where exits may sit.

The fields cover the five methods FedFit implements:

- HeteroFL: a uniform ``width`` rate (levels 1, 1/2, 1/4, ...), channels rounded up.
- ScaleFL: ``width`` with ``rounding="floor"``, ``depth`` (body blocks kept) and ``exits`` (blocks followed by
  an early-exit head; a model cut at depth ``d`` ends with the exit after block ``d - 1``).
- FlexFL / AdaptiveFL: per-layer rates in ``layer_widths`` (keys are the family's ``layer_names()``).
- FeDepth: ``segments``, the consecutive block ranges trained one after another, in order (blocks outside
  every segment are frozen: run, not trained, not uploaded).
- FedRolex: ``width`` and ``roll``, the start of a cyclic window of each hidden layer's channels
  (``(roll + i) mod C``): where the sub-model sits in the global model, which only the coordinator needs (the
  sub-model itself is the same as without it, and goes to agents without it: :meth:`SubmodelSpec.unrolled`).

Block indices are 0-based positions in the family's body (block 0 is the one nearest the input and holds the
stem). Every invalid value raises ``ValueError`` (also for wrong types): a spec usually arrives as decoded wire
data, and the protocol turns exactly one exception class into a clear error message.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from models.width import ROUNDINGS

__all__ = ["SubmodelSpec"]

_FIELDS = ("width", "layer_widths", "rounding", "depth", "exits", "segments", "roll")


def _check_rate(what: str, rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ValueError(f"{what} must be a number in (0, 1], got {rate!r}.")  # noqa: TRY004
    value = float(rate)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {rate!r}.")
    return value


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_exits(values: object) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"exits must be a sequence of block indices, got {values!r}.")  # noqa: TRY004
    out = list(values)
    for v in out:
        if not _is_index(v):
            raise ValueError(f"exits must hold non-negative integer block indices, got {v!r}.")
    if len(set(out)) != len(out):
        raise ValueError(f"exits must not repeat a block index, got {tuple(out)!r}.")
    return tuple(sorted(out))


def _check_segments(values: object) -> tuple[tuple[int, int], ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"segments must be a sequence of [start, stop) block ranges, got {values!r}.")  # noqa: TRY004
    out: list[tuple[int, int]] = []
    for pair in values:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_index(v) for v in pair)
                or pair[0] > pair[1]):
            raise ValueError(f"every segment must be a block range [start, stop) with 0 <= start < stop (or "
                             f"start == stop: the head alone), got {pair!r}.")
        out.append((int(pair[0]), int(pair[1])))
    if not out:
        raise ValueError("segments must name at least one block range (None trains the whole model at once).")
    if any(start == stop for start, stop in out) and len(out) > 1:
        raise ValueError(f"an empty segment (the head alone) must be the only one, got {tuple(out)!r}.")
    ordered = sorted(out)
    for (_, stop), (start, _) in itertools.pairwise(ordered):
        if start < stop:
            raise ValueError(f"segments must not overlap, got {tuple(out)!r}.")
    return tuple(out)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


@dataclass(frozen=True)
class SubmodelSpec:
    """What one client trains, relative to the global (full) model of a family.

    Attributes
    ----------
    width:
        Uniform width rate in (0, 1] applied to every hidden layer.
    layer_widths:
        Per-layer overrides ``((name, rate), ...)``, keyed by the family's layer names. Any iterable of pairs
        or a mapping is accepted and normalised to a tuple sorted by name, so equal specs hash equally.
    rounding:
        How a rate becomes a channel count: ``"ceil"`` (HeteroFL) or ``"floor"`` (ScaleFL).
    depth:
        Number of body blocks kept (``None`` = all, with the family's final head).
    exits:
        Block indices after which an early-exit head exists (sorted, unique).
    segments:
        ``None``: the whole sub-model is trained at once. Otherwise ``((start, stop), ...)``: block ranges
        trained one after another in the order given (depth-wise training); blocks in no segment are frozen.
        One empty range at the depth, ``((depth, depth),)``, trains the final head alone on the frozen output
        of every block (FeDepth's partial training where no block fits).
    roll:
        Where the kept channels of every hidden layer start in the global model: channel ``i`` of the
        sub-model is global channel ``(roll + i) mod C`` (FedRolex's rolling window; any integer, negative rolls
        backwards). 0: the leading prefix. It moves no shape, only the positions of the index maps.
    """

    width: float = 1.0
    layer_widths: tuple[tuple[str, float], ...] = ()
    rounding: str = "ceil"
    depth: int | None = None
    exits: tuple[int, ...] = ()
    segments: tuple[tuple[int, int], ...] | None = None
    roll: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.roll, bool) or not isinstance(self.roll, int):
            raise ValueError(f"roll must be an integer, got {self.roll!r}.")  # noqa: TRY004 - wire data
        object.__setattr__(self, "width", _check_rate("width", self.width))

        raw: Any = self.layer_widths
        if isinstance(raw, Mapping):
            pairs = list(raw.items())
        elif isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise ValueError(f"layer_widths must be pairs of (layer name, rate), got {raw!r}.")  # noqa: TRY004
        else:
            pairs = list(raw)
        normalised: dict[str, float] = {}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"layer_widths entries must be (layer name, rate) pairs, got {pair!r}.")
            name, rate = pair
            if not isinstance(name, str) or not name:
                raise ValueError(f"layer_widths keys must be non-empty layer names, got {name!r}.")
            if name in normalised:
                raise ValueError(f"layer_widths names layer {name!r} more than once.")
            normalised[name] = _check_rate(f"layer_widths[{name!r}]", rate)
        object.__setattr__(self, "layer_widths", tuple(sorted(normalised.items())))

        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}.")

        depth = self.depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be a positive integer or None, got {depth!r}.")

        exits = _check_exits(self.exits)
        object.__setattr__(self, "exits", exits)
        if depth is not None and exits and exits[-1] >= depth:
            raise ValueError(f"exits {exits!r} must lie inside the {depth} kept blocks (indices 0..{depth - 1}).")

        if self.segments is not None:
            segments = _check_segments(self.segments)
            object.__setattr__(self, "segments", segments)
            if depth is not None and max(stop for _, stop in segments) > depth:
                raise ValueError(f"segments {segments!r} must lie inside the {depth} kept blocks "
                                 f"(indices 0..{depth - 1}).")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, rate: float, rounding: str = "ceil") -> SubmodelSpec:
        """HeteroFL level: every hidden layer at width ``rate``."""
        return cls(width=rate, rounding=rounding)

    @classmethod
    def full(cls) -> SubmodelSpec:
        """The global model itself."""
        return cls()

    def rolled(self, roll: int) -> SubmodelSpec:
        """This sub-model with its window starting at ``roll``."""
        return replace(self, roll=roll)

    def unrolled(self) -> SubmodelSpec:
        """This sub-model at the leading prefix: what an agent is told it trains (its shapes are the same)."""
        return replace(self, roll=0) if self.roll else self

    # ------------------------------------------------------------------ queries
    def rate_for(self, layer: str) -> float:
        """Width rate of ``layer``: its override in ``layer_widths`` or the uniform ``width``."""
        for name, rate in self.layer_widths:
            if name == layer:
                return rate
        return self.width

    @property
    def full_width(self) -> bool:
        """True when every rate is 1 (overrides with rate 1 count as full)."""
        return self.width == 1.0 and all(rate == 1.0 for _, rate in self.layer_widths)

    @property
    def is_full(self) -> bool:
        """True when this spec describes the whole global model, trained whole: full width, all blocks kept,
        no early exits, no segments."""
        return self.full_width and self.depth is None and not self.exits and self.segments is None

    @property
    def head_only(self) -> bool:
        """True when this spec trains the head alone (one empty segment, FeDepth's last resort): no body block
        is trained, every one runs frozen."""
        return self.segments is not None and self.segments[0][0] == self.segments[0][1]

    def describe(self) -> str:
        """Short readable form, e.g. ``"width=0.5"`` or ``"width=0.7 floor depth=35 exits=34"``."""
        parts = [f"width={_fmt(self.width)}"]
        parts += [f"{name}={_fmt(rate)}" for name, rate in self.layer_widths]
        if self.rounding != "ceil":
            parts.append(self.rounding)
        if self.depth is not None:
            parts.append(f"depth={self.depth}")
        if self.exits:
            parts.append("exits=" + ",".join(str(i) for i in self.exits))
        if self.segments is not None:
            parts.append("segments=" + ",".join(f"{start}:{stop}" for start, stop in self.segments))
        if self.roll:
            parts.append(f"roll={self.roll}")
        return " ".join(parts)

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------ wire form
    def to_dict(self) -> dict[str, Any]:
        """Msgpack-friendly form (str, float, int, list, dict only), omitting fields at their defaults."""
        out: dict[str, Any] = {}
        if self.width != 1.0:
            out["width"] = self.width
        if self.layer_widths:
            out["layer_widths"] = {name: rate for name, rate in self.layer_widths}
        if self.rounding != "ceil":
            out["rounding"] = self.rounding
        if self.depth is not None:
            out["depth"] = self.depth
        if self.exits:
            out["exits"] = list(self.exits)
        if self.segments is not None:
            out["segments"] = [[start, stop] for start, stop in self.segments]
        if self.roll:
            out["roll"] = self.roll
        return out

    @classmethod
    def from_dict(cls, d: object) -> SubmodelSpec:
        """Strict inverse of :meth:`to_dict`.

        Raises
        ------
        ValueError
            If ``d`` is not a mapping with string keys, has an unknown key, or a value of the wrong type; the
            message names the offending key.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a sub-model spec must be a mapping, got {type(d).__name__}.")  # noqa: TRY004
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in _FIELDS:
                raise ValueError(f"unknown sub-model spec key {key!r}; valid keys are {', '.join(_FIELDS)}.")
            if key == "width":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"sub-model spec key 'width' must be a number, got {value!r}.")
            elif key == "layer_widths":
                if not isinstance(value, Mapping):
                    raise ValueError(
                        f"sub-model spec key 'layer_widths' must map layer names to rates, got {value!r}."
                    )
                for name, rate in value.items():
                    if (
                        not isinstance(name, str)
                        or isinstance(rate, bool)
                        or not isinstance(rate, (int, float))
                    ):
                        raise ValueError(  # noqa: TRY004
                            "sub-model spec key 'layer_widths' must map layer names (str) to rates "
                            f"(numbers), got {name!r}: {rate!r}."
                        )
                value = tuple(value.items())
            elif key == "rounding":
                if not isinstance(value, str):
                    raise ValueError(f"sub-model spec key 'rounding' must be a string, got {value!r}.")
            elif key == "depth":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                    raise ValueError(f"sub-model spec key 'depth' must be an integer, got {value!r}.")
            elif key == "roll":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"sub-model spec key 'roll' must be an integer, got {value!r}.")
            elif key == "exits":
                if not isinstance(value, (list, tuple)) or any(
                    isinstance(v, bool) or not isinstance(v, int) for v in value
                ):
                    raise ValueError(f"sub-model spec key 'exits' must be a list of integers, got {value!r}.")
                value = tuple(value)
            elif value is not None:  # segments
                if not isinstance(value, (list, tuple)) or any(
                    not isinstance(pair, (list, tuple)) or len(pair) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)
                    for pair in value
                ):
                    raise ValueError("sub-model spec key 'segments' must be a list of [start, stop] integer "
                                     f"pairs, got {value!r}.")
                value = tuple(tuple(pair) for pair in value)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"invalid sub-model spec: {exc}") from None
