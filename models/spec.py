"""Sub-model specifications: what one client trains.

A :class:`SubmodelSpec` is plain data. It travels inside a task message (``to_dict`` / ``from_dict`` use
msgpack-friendly primitives only) and is interpreted by a :class:`models.family.ModelFamily`, which knows
the layer names and which spec features it implements.

The fields cover the five methods FedFit implements:

- HeteroFL: a uniform ``width`` rate (levels 1, 1/2, 1/4, ...).
- FlexFL / AdaptiveFL: per-layer rates in ``layer_widths`` (keys are the family's ``layer_names()``).
- ScaleFL: ``depth`` (body blocks kept) and ``exits`` (blocks followed by an early-exit head).
- FeDepth: ``trainable_blocks`` (blocks updated by this task; the others are frozen).

Block indices are 0-based positions in the family's body (block 0 is the one nearest the input).

Every invalid value raises ``ValueError`` (also for wrong types): a spec usually arrives as decoded wire data,
and the protocol turns exactly one exception class into a clear error message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SubmodelSpec"]

_FIELDS = ("width", "layer_widths", "depth", "exits", "trainable_blocks")


def _check_rate(what: str, rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ValueError(f"{what} must be a number in (0, 1], got {rate!r}.")  # noqa: TRY004
    value = float(rate)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {rate!r}.")
    return value


def _check_index_tuple(what: str, values: object) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{what} must be a sequence of block indices, got {values!r}.")  # noqa: TRY004
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what} must hold non-negative integer block indices, got {v!r}.")
        out.append(int(v))
    if len(set(out)) != len(out):
        raise ValueError(f"{what} must not repeat a block index, got {tuple(out)!r}.")
    return tuple(sorted(out))


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
    depth:
        Number of body blocks kept (``None`` = all).
    exits:
        Block indices after which an early-exit head exists (sorted, unique).
    trainable_blocks:
        Block indices being trained (``None`` = all; sorted, unique).
    """

    width: float = 1.0
    layer_widths: tuple[tuple[str, float], ...] = ()
    depth: int | None = None
    exits: tuple[int, ...] = ()
    trainable_blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
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

        depth = self.depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be a positive integer or None, got {depth!r}.")

        exits = _check_index_tuple("exits", self.exits)
        object.__setattr__(self, "exits", exits)
        if self.depth is not None and exits and exits[-1] >= self.depth:
            raise ValueError(
                f"exits {exits!r} must lie inside the {self.depth} kept blocks (indices 0..{self.depth - 1})."
            )

        if self.trainable_blocks is not None:
            blocks = _check_index_tuple("trainable_blocks", self.trainable_blocks)
            object.__setattr__(self, "trainable_blocks", blocks)
            if self.depth is not None and blocks and blocks[-1] >= self.depth:
                raise ValueError(
                    f"trainable_blocks {blocks!r} must lie inside the {self.depth} kept blocks "
                    f"(indices 0..{self.depth - 1})."
                )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, rate: float) -> SubmodelSpec:
        """HeteroFL level: every hidden layer at width ``rate``."""
        return cls(width=rate)

    @classmethod
    def full(cls) -> SubmodelSpec:
        """The global model itself."""
        return cls()

    # ------------------------------------------------------------------ queries
    def rate_for(self, layer: str) -> float:
        """Width rate of ``layer``: its override in ``layer_widths`` or the uniform ``width``."""
        for name, rate in self.layer_widths:
            if name == layer:
                return rate
        return self.width

    @property
    def is_full(self) -> bool:
        """True when this spec describes the whole global model, trained whole.

        Every rate is 1, all blocks are kept, there are no early exits and every block is trainable (overrides
        with rate 1 count as full).
        """
        return (
            self.width == 1.0
            and all(rate == 1.0 for _, rate in self.layer_widths)
            and self.depth is None
            and not self.exits
            and self.trainable_blocks is None
        )

    def describe(self) -> str:
        """Short readable form, e.g. ``"width=0.5"`` or ``"width=0.25 conv2=0.5 depth=3"``."""
        parts = [f"width={_fmt(self.width)}"]
        parts += [f"{name}={_fmt(rate)}" for name, rate in self.layer_widths]
        if self.depth is not None:
            parts.append(f"depth={self.depth}")
        if self.exits:
            parts.append("exits=" + ",".join(str(i) for i in self.exits))
        if self.trainable_blocks is not None:
            parts.append("trainable=" + (",".join(str(i) for i in self.trainable_blocks) or "none"))
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
        if self.depth is not None:
            out["depth"] = self.depth
        if self.exits:
            out["exits"] = list(self.exits)
        if self.trainable_blocks is not None:
            out["trainable_blocks"] = list(self.trainable_blocks)
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
            elif key == "depth":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                    raise ValueError(f"sub-model spec key 'depth' must be an integer, got {value!r}.")
            else:  # exits, trainable_blocks
                if value is None and key == "trainable_blocks":
                    pass
                elif not isinstance(value, (list, tuple)) or any(
                    isinstance(v, bool) or not isinstance(v, int) for v in value
                ):
                    raise ValueError(f"sub-model spec key {key!r} must be a list of integers, got {value!r}.")
                else:
                    value = tuple(value)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"invalid sub-model spec: {exc}") from None
