"""The model-family base class: one place for structure, index maps, slicing, nesting and costs.

A concrete family only *declares* its architecture, once:

- ``_channel_groups()``: the named channel dimensions that can be narrowed (the names ``layer_widths`` may
  use) with their global sizes. Layers that must agree on a width (e.g. every layer writing to one residual
  stream) share one group.
- ``_declare_layers()``: one :class:`LayerDecl` per module that owns state, in registration order, saying which
  group feeds it, which group it produces and which **body block** it belongs to. Blocks are numbered 0.. in
  depth order, the stem belongs to block 0 and the final head to no block (``block=None``). This one numbering
  is used by the builder, the index maps, the FLOPs and the memory estimator.
- ``_build_body()``: the registered modules for the kept channels and the first ``depth`` blocks, with views of
  the blocks and the final head (:class:`models.net.BodyParts`).
- Optionally ``_exit_points()`` (blocks an early exit may follow; default every block but the last) and the
  ``exit_convs`` option (convolutions per exit head).

Early-exit heads are declared here from that, for every exit point: ``exit_convs`` convolutions at the width of
the block's output (each its own channel group ``exits.{b}.conv{i}``), then pooling and a classifier; their
``state_dict`` keys are ``exits.{b}.*``. Everything else (index maps, extraction, key lists, parameter counts,
FLOPs, nesting) follows from the declaration, so a new family cannot get the slicing rules subtly different
from the others. Tests check that the declaration matches the built module's ``state_dict`` key for key and
shape for shape, for every family, spec feature and combination.

Slicing rule (HeteroFL, and the default of every method FedFit implements): each dimension keeps the leading
prefix of the global dimension; a layer's input indices are its input group's kept indices; the model input
channels and the classifier's class rows are never sliced. Because ``scaled_channels`` is monotone in the rate,
a narrower spec with the same rounding is nested inside a wider one (:meth:`ModelFamily.is_nested`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from models._checks import check_input_size, check_positive_int
from models.net import BodyParts, ExitHead, FamilyNet
from models.spec import SubmodelSpec
from models.width import scaled_channels

__all__ = ["BYTES_PER_ELEMENT", "LayerDecl", "ModelFamily", "bn_decl", "conv_bn_chain", "conv_decl", "linear_decl"]

#: Bytes per element of every tensor FedFit trains (float32).
BYTES_PER_ELEMENT = 4

LayerKind = Literal["conv", "bn", "linear"]


@dataclass(frozen=True)
class LayerDecl:
    """One module that owns state, as the family declares it.

    Attributes
    ----------
    name:
        Module path in the built model (``state_dict`` keys are ``f"{name}.weight"`` etc.).
    kind:
        ``"conv"`` (weight ``[out, in, *kernel]``, optional bias ``[out]``), ``"linear"`` (weight ``[out, in]``,
        optional bias) or ``"bn"`` (weight, bias, and with tracked statistics running_mean, running_var,
        num_batches_tracked).
    in_group:
        Channel group feeding the layer; ``None`` = the model input (never sliced). Equals ``out_group`` for bn.
    out_group:
        Channel group the layer produces; ``None`` = the classes (never sliced; a classifier).
    kernel:
        Spatial kernel size of a conv.
    bias:
        Whether a conv or linear layer has a bias.
    block:
        Body block the layer belongs to (0-based, the stem in block 0), or ``None`` for the final head and for
        exit heads.
    exit:
        For a layer of an early-exit head, the block the exit follows; ``None`` otherwise.
    """

    name: str
    kind: LayerKind
    in_group: str | None
    out_group: str | None
    kernel: tuple[int, ...] = ()
    bias: bool = True
    block: int | None = None
    exit: int | None = None


def conv_decl(
    name: str,
    in_group: str | None,
    out_group: str | None,
    kernel: tuple[int, ...] = (3, 3),
    *,
    bias: bool = True,
    block: int | None = None,
    exit: int | None = None,
) -> LayerDecl:
    """Declare a convolution."""
    return LayerDecl(name, "conv", in_group, out_group, tuple(kernel), bias, block, exit)


def bn_decl(name: str, group: str, *, block: int | None = None, exit: int | None = None) -> LayerDecl:
    """Declare a (static) batch norm over ``group``."""
    return LayerDecl(name, "bn", group, group, (), True, block, exit)


def conv_bn_chain(count: int) -> list[LayerDecl]:
    """``count`` plain 3x3 convolutions (with bias) each followed by its batch norm, ``conv{i}``/``bn{i}``
    producing group ``conv{i}``, one body block each (block ``i - 1``), the first reading the model input."""
    decls: list[LayerDecl] = []
    previous: str | None = None
    for i in range(1, count + 1):
        group = f"conv{i}"
        decls.append(conv_decl(group, previous, group, (3, 3), bias=True, block=i - 1))
        decls.append(bn_decl(f"bn{i}", group, block=i - 1))
        previous = group
    return decls


def linear_decl(
    name: str,
    in_group: str | None,
    out_group: str | None = None,
    *,
    bias: bool = True,
    block: int | None = None,
    exit: int | None = None,
) -> LayerDecl:
    """Declare a linear layer (``out_group=None``: a classifier)."""
    return LayerDecl(name, "linear", in_group, out_group, (), bias, block, exit)


class ModelFamily(abc.ABC):
    """A model architecture that can be built at any :class:`SubmodelSpec`.

    Parameters
    ----------
    num_classes:
        Number of output classes (classifier rows; never sliced).
    in_channels:
        Channels of the input images (never sliced).
    **options:
        Family-specific options; see each family's ``option_defaults``. Unknown options raise ``ValueError``.
        Every family takes ``exit_convs``: convolutions per early-exit head.
    """

    #: Registry name of the family.
    name: ClassVar[str] = ""
    #: Options the family accepts, with their defaults (``exit_convs`` is added for every family).
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: Default number of convolutions per early-exit head (ScaleFL's reference uses 3).
    default_exit_convs: ClassVar[int] = 3

    def __init__(self, num_classes: int, in_channels: int, **options: Any) -> None:
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.in_channels = check_positive_int("in_channels", in_channels)
        defaults = {**self.option_defaults, "exit_convs": self.default_exit_convs}
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            valid = ", ".join(sorted(defaults))
            raise ValueError(
                f"unknown option {unknown[0]!r} for model family {self.name!r}; valid options: {valid}."
            )
        merged = {**defaults, **options}
        exit_convs = merged.pop("exit_convs")
        if isinstance(exit_convs, bool) or not isinstance(exit_convs, int) or exit_convs < 0:
            raise ValueError(f"exit_convs must be a non-negative integer, got {exit_convs!r}.")
        self.options: dict[str, Any] = {**self._validate_options(merged), "exit_convs": exit_convs}
        body_groups = dict(self._channel_groups())
        body_layers = tuple(self._declare_layers())
        blocks = [d.block for d in body_layers if d.block is not None]
        if not blocks or sorted(set(blocks)) != list(range(max(blocks) + 1)):
            raise ValueError(f"family {self.name!r} must declare body blocks numbered 0, 1, 2, ... in order.")
        self._num_blocks = max(blocks) + 1
        self._exit_points = tuple(self._declare_exit_points())
        if any(not 0 <= b < self._num_blocks - 1 for b in self._exit_points):
            raise ValueError(f"family {self.name!r}: exits may follow blocks 0..{self._num_blocks - 2} only.")
        exit_groups, exit_layers = self._declare_exits(body_groups, body_layers)
        self._groups: dict[str, int] = {**body_groups, **exit_groups}
        self._layers: tuple[LayerDecl, ...] = body_layers + exit_layers
        self._check_declaration()
        self._spatial_cache: dict[tuple[int, int], dict[str, int]] = {}
        self._groups_of_keys: dict[str, tuple[str | None, ...]] | None = None

    # ------------------------------------------------------------------ what a family declares
    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise the merged family options; override in families with options."""
        return options

    @abc.abstractmethod
    def _channel_groups(self) -> Mapping[str, int]:
        """Named channel groups of the body and final head and their global sizes, in order."""

    @abc.abstractmethod
    def _declare_layers(self) -> Sequence[LayerDecl]:
        """Every module of the body and final head that owns state, in registration (``state_dict``) order."""

    @abc.abstractmethod
    def _build_body(self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool,
                    depth: int) -> BodyParts:
        """The modules of the first ``depth`` blocks (and the final head when ``depth`` is every block), with
        ``channels[group]`` channels and Scaler rate ``rates[group]`` per group."""

    def _declare_exit_points(self) -> Sequence[int]:
        """Blocks an early exit may follow (default: every block but the last, which the final head follows)."""
        return range(self._num_blocks - 1)

    # ------------------------------------------------------------------ exits, derived from the declaration
    def _block_output_group(self, block: int, layers: Sequence[LayerDecl]) -> str:
        groups = [d.out_group for d in layers if d.block == block and d.out_group is not None]
        if not groups:
            raise ValueError(f"family {self.name!r}: block {block} declares no layer producing channels.")
        return groups[-1]

    def _declare_exits(self, groups: Mapping[str, int], layers: Sequence[LayerDecl]
                       ) -> tuple[dict[str, int], tuple[LayerDecl, ...]]:
        convs = self.options["exit_convs"]
        exit_groups: dict[str, int] = {}
        decls: list[LayerDecl] = []
        for b in self._exit_points:
            source = self._block_output_group(b, layers)
            previous = source
            for i in range(1, convs + 1):
                group = f"exits.{b}.conv{i}"
                exit_groups[group] = groups[source]
                decls.append(conv_decl(f"exits.{b}.conv{i}", previous, group, (3, 3), bias=False, exit=b))
                decls.append(bn_decl(f"exits.{b}.bn{i}", group, exit=b))
                previous = group
            decls.append(linear_decl(f"exits.{b}.classifier", previous, None, exit=b))
        return exit_groups, tuple(decls)

    def _check_declaration(self) -> None:
        seen: set[str] = set()
        for decl in self._layers:
            if decl.name in seen:
                raise ValueError(f"family {self.name!r} declares layer {decl.name!r} twice.")
            seen.add(decl.name)
            for group in (decl.in_group, decl.out_group):
                if group is not None and group not in self._groups:
                    raise ValueError(
                        f"family {self.name!r}: layer {decl.name!r} uses unknown group {group!r}."
                    )
            if decl.kind == "bn" and (decl.in_group is None or decl.in_group != decl.out_group):
                raise ValueError(f"family {self.name!r}: batch norm {decl.name!r} needs one channel group.")
        if not any(d.out_group is None and d.block is None and d.exit is None for d in self._layers):
            raise ValueError(f"family {self.name!r} declares no final classifier (a head layer with "
                             "out_group=None).")

    # ------------------------------------------------------------------ structure
    @property
    def num_blocks(self) -> int:
        """Body blocks of the full model (block 0 holds the stem)."""
        return self._num_blocks

    @property
    def exit_points(self) -> tuple[int, ...]:
        """Blocks an early-exit head may follow."""
        return self._exit_points

    @property
    def stage_ends(self) -> tuple[int, ...]:
        """The depth (blocks kept) at the end of each stage, deepest last: a stage is a run of consecutive blocks
        writing the same channel stream (PreResNet-20's three stages of three blocks: ``(3, 6, 9)``; every block
        of a plain CNN, whose blocks each write their own)."""
        body = [d for d in self._layers if d.exit is None]
        outputs = [self._block_output_group(b, body) for b in range(self._num_blocks)]
        return tuple(b + 1 for b in range(self._num_blocks) if b + 1 == self._num_blocks or outputs[b + 1] != outputs[b])

    def layer_names(self) -> tuple[str, ...]:
        """Names that ``SubmodelSpec.layer_widths`` may use for this family (exit heads' groups included)."""
        return tuple(self._groups)

    def prunable_layers(self) -> tuple[str, ...]:
        """The body's channel groups in depth order (the exits' excluded): what per-layer width methods prune."""
        return tuple(g for g in self._groups if not g.startswith("exits."))

    def layers(self) -> tuple[LayerDecl, ...]:
        """Every declared stateful layer (body, final head, then the exit heads), in ``state_dict`` order."""
        return self._layers

    # ------------------------------------------------------------------ spec handling
    def validate_spec(self, spec: SubmodelSpec | None = None) -> SubmodelSpec:
        """Return ``spec`` (``None`` -> full) after checking it fits this family.

        Raises
        ------
        ValueError
            For a layer name the family does not have, a depth beyond its blocks, an exit where none may sit, a
            cut body without an exit after its last block, or a segment beyond the kept blocks.
        """
        if spec is None:
            return SubmodelSpec.full()
        if not isinstance(spec, SubmodelSpec):
            raise ValueError(f"expected a SubmodelSpec, got {type(spec).__name__}.")  # noqa: TRY004
        for layer, _ in spec.layer_widths:
            if layer not in self._groups:
                raise ValueError(
                    f"layer_widths names unknown layer {layer!r} for family {self.name!r}; "
                    f"valid layers: {', '.join(self._groups)}."
                )
        depth = self._depth(spec)
        if depth > self._num_blocks:
            raise ValueError(f"depth {depth} exceeds the {self._num_blocks} blocks of family {self.name!r}.")
        for b in spec.exits:
            if b not in self._exit_points:
                raise ValueError(f"family {self.name!r} has no exit point after block {b}; exits may follow "
                                 f"blocks {_ranges(self._exit_points)}.")
        if depth < self._num_blocks and (not spec.exits or spec.exits[-1] != depth - 1):
            raise ValueError(f"a sub-model cut after block {depth - 1} needs an exit there (exits={list(spec.exits)})"
                             ".")
        if spec.segments is not None and max(stop for _, stop in spec.segments) > depth:
            raise ValueError(f"segments {[list(s) for s in spec.segments]} reach beyond the {depth} blocks kept.")
        if spec.segments is not None and spec.segments[0][0] == spec.segments[0][1] != depth:
            raise ValueError(f"an empty segment trains the head alone, after every kept block: [{depth}, {depth}), "
                             f"got {list(spec.segments[0])}.")
        return spec

    def _depth(self, spec: SubmodelSpec) -> int:
        return self._num_blocks if spec.depth is None else spec.depth

    def kept_channels(self, spec: SubmodelSpec | None = None) -> dict[str, int]:
        """Channels each group keeps under ``spec`` (``ceil`` or ``floor`` of ``rate * global``)."""
        spec = self.validate_spec(spec)
        return {g: scaled_channels(c, spec.rate_for(g), spec.rounding) for g, c in self._groups.items()}

    def _present(self, decl: LayerDecl, spec: SubmodelSpec, depth: int) -> bool:
        if decl.exit is not None:
            return decl.exit in spec.exits
        if decl.block is None:
            return depth == self._num_blocks
        return decl.block < depth

    def num_outputs(self, spec: SubmodelSpec | None = None) -> int:
        """How many logits ``build(spec).forward_exits`` returns: its exits, and the final head when it is kept."""
        spec = self.validate_spec(spec)
        return len(spec.exits) + (self._depth(spec) == self._num_blocks)

    def trained_blocks(self, spec: SubmodelSpec | None = None) -> tuple[int, ...]:
        """The blocks ``spec`` trains: every kept block, or those inside its segments."""
        spec = self.validate_spec(spec)
        if spec.segments is None:
            return tuple(range(self._depth(spec)))
        return tuple(sorted(b for start, stop in spec.segments for b in range(start, stop)))

    def _trained(self, decl: LayerDecl, spec: SubmodelSpec, depth: int, blocks: set[int]) -> bool:
        if decl.block is not None:
            return decl.block in blocks
        if decl.exit is not None:
            # Trained whole, every exit trains with its block; depth-wise, an exit trains when it closes a segment
            # (the route of auxiliary classifiers) or is the model's output.
            if spec.segments is None or decl.exit == depth - 1:
                return decl.exit in blocks or decl.exit == depth - 1
            return any(stop - 1 == decl.exit for _, stop in spec.segments)
        return True  # the final head trains in every stage

    def _spec_layers(self, spec: SubmodelSpec) -> list[LayerDecl]:
        depth = self._depth(spec)
        return [d for d in self._layers if self._present(d, spec, depth)]

    # ------------------------------------------------------------------ building
    def build(self, spec: SubmodelSpec | None = None, *, track_bn_stats: bool = True) -> FamilyNet:
        """Build the sub-model for ``spec`` (``None`` = the full model), in train mode.

        ``track_bn_stats=False`` is what the edge trains (static BN: batch statistics only, no running buffers
        in the ``state_dict``); ``True`` is what the server evaluates (cumulative running statistics).
        """
        spec = self.validate_spec(spec)
        channels = self.kept_channels(spec)
        rates = {g: spec.rate_for(g) for g in self._groups}
        parts = self._build_body(channels, rates, track_bn_stats, self._depth(spec))
        exits = {b: self._build_exit(b, channels, rates, track_bn_stats) for b in spec.exits}
        return FamilyNet(parts, exits).train()

    def _build_exit(self, block: int, channels: Mapping[str, int], rates: Mapping[str, float],
                    track_bn_stats: bool) -> ExitHead:
        decls = [d for d in self._layers if d.exit == block]
        convs = [d for d in decls if d.kind == "conv"]
        source = decls[0].in_group
        assert source is not None
        return ExitHead(channels[source], [channels[d.out_group] for d in convs if d.out_group],
                        [rates[d.out_group] for d in convs if d.out_group], self.num_classes, track_bn_stats)

    # ------------------------------------------------------------------ index maps and slicing
    def _group_size(self, group: str | None, channels: Mapping[str, int], *, is_input: bool) -> int:
        if group is None:
            return self.in_channels if is_input else self.num_classes
        return channels[group]

    def _shapes(self, layers: Iterable[LayerDecl], channels: Mapping[str, int],
                track_bn_stats: bool) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for d in layers:
            cin = self._group_size(d.in_group, channels, is_input=True)
            cout = self._group_size(d.out_group, channels, is_input=False)
            if d.kind == "bn":
                shapes[f"{d.name}.weight"] = (cout,)
                shapes[f"{d.name}.bias"] = (cout,)
                if track_bn_stats:
                    shapes[f"{d.name}.running_mean"] = (cout,)
                    shapes[f"{d.name}.running_var"] = (cout,)
                    shapes[f"{d.name}.num_batches_tracked"] = ()
                continue
            shapes[f"{d.name}.weight"] = (cout, cin, *d.kernel)
            if d.bias:
                shapes[f"{d.name}.bias"] = (cout,)
        return shapes

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every ``state_dict`` tensor any spec may have, at full width with BN statistics tracked (the
        final head and the exit heads at every exit point included)."""
        return self._shapes(self._layers, self._groups, True)

    def shapes(self, spec: SubmodelSpec | None = None, *, track_bn_stats: bool = True) -> dict[str, tuple[int, ...]]:
        """Shape of every ``state_dict`` tensor of ``build(spec, track_bn_stats=...)``, in order."""
        spec = self.validate_spec(spec)
        return self._shapes(self._spec_layers(spec), self.kept_channels(spec), track_bn_stats)

    def index_map(self, spec: SubmodelSpec | None = None) -> dict[str, tuple[torch.Tensor, ...]]:
        """Positions in the global tensors of every ``state_dict`` tensor of ``build(spec)``.

        For each key, one int64 index tensor per dimension, so that
        ``global[key][torch.meshgrid(*idx, indexing="ij")]`` has the sub-model's shape. Scalars
        (``num_batches_tracked``) map to ``()``. The indices are leading prefixes (see the module docstring),
        except under a ``roll``: a narrowed hidden channel group of ``C`` channels keeping ``k`` takes
        ``(roll + i) mod C`` for ``i < k`` (FedRolex's window; a whole group, ``k = C``, is rotated alike); input
        channels, classes and kernels stay as they are.
        """
        spec = self.validate_spec(spec)
        prefix = {key: tuple(torch.arange(n, dtype=torch.int64) for n in shape)
                  for key, shape in self.shapes(spec).items()}
        if not spec.roll:
            return prefix
        groups = self._key_groups()
        return {key: tuple(self._window(groups[key][dim], idx, spec.roll) if dim < len(groups[key]) else idx
                           for dim, idx in enumerate(indices))
                for key, indices in prefix.items()}

    def _key_groups(self) -> dict[str, tuple[str | None, ...]]:
        """The channel group of each channel dimension of every state key (output, then input; None: classes or
        input channels)."""
        if self._groups_of_keys is None:
            found: dict[str, tuple[str | None, ...]] = {}
            for d in self._layers:
                if d.kind == "bn":
                    for part in ("weight", "bias", "running_mean", "running_var"):
                        found[f"{d.name}.{part}"] = (d.out_group,)
                    found[f"{d.name}.num_batches_tracked"] = ()
                    continue
                found[f"{d.name}.weight"] = (d.out_group, d.in_group)
                if d.bias:
                    found[f"{d.name}.bias"] = (d.out_group,)
            self._groups_of_keys = found
        return self._groups_of_keys

    def _window(self, group: str | None, kept: torch.Tensor, roll: int) -> torch.Tensor:
        """The global positions of a dimension's ``kept`` channels under ``roll``."""
        if group is None:
            return kept
        # A whole group rolls too (a permutation, the same in every layer it connects): a smaller window, cut
        # from the front of what an agent was sent, is then always the front of the larger one.
        return (kept + roll) % self._groups[group]

    def state_keys(self, spec: SubmodelSpec | None = None) -> tuple[str, ...]:
        """``state_dict`` keys of ``build(spec, track_bn_stats=False)``: the weights a task sends down."""
        return tuple(self.shapes(spec, track_bn_stats=False))

    def trainable_keys(self, spec: SubmodelSpec | None = None) -> tuple[str, ...]:
        """The keys of :meth:`state_keys` that training updates: what an update carries back.

        All of them, unless ``spec`` has segments: then the trained blocks' layers, their exits, and the head
        that produces the model's output (frozen blocks run but are neither updated nor uploaded).
        """
        spec = self.validate_spec(spec)
        depth = self._depth(spec)
        blocks = set(self.trained_blocks(spec))
        layers = [d for d in self._spec_layers(spec) if self._trained(d, spec, depth, blocks)]
        return tuple(self._shapes(layers, self.kept_channels(spec), False))

    def classifier_keys(self, spec: SubmodelSpec | None = None) -> tuple[str, ...]:
        """Keys whose dim 0 is the class dimension (weight and bias of the final classifier and of every exit
        classifier; only those of ``spec`` when it is given)."""
        layers = self._layers if spec is None else self._spec_layers(self.validate_spec(spec))
        keys: list[str] = []
        for d in layers:
            if d.out_group is None:
                keys.append(f"{d.name}.weight")
                if d.bias:
                    keys.append(f"{d.name}.bias")
        return tuple(keys)

    def head_keys(self, exit_block: int | None = None) -> tuple[str, ...]:
        """The trainable state keys of one output's head: the early exit after block ``exit_block``, or the final
        head (None)."""
        layers = [d for d in self._layers
                  if d.exit == exit_block and (exit_block is not None or d.block is None)]
        return tuple(self._shapes(layers, self._groups, False))

    def is_nested(self, inner: SubmodelSpec | None, outer: SubmodelSpec | None) -> bool:
        """Whether every tensor of ``inner`` lies inside ``outer``'s (same keys or fewer, each a prefix at most as
        large), and ``inner`` trains nothing ``outer`` does not. The coordinator refuses an update whose trained
        spec is not nested inside the spec it sent; an agent adapts only to nested candidates."""
        outer_shapes = self.shapes(outer)
        for key, shape in self.shapes(inner).items():
            other = outer_shapes.get(key)
            if other is None or any(a > b for a, b in zip(shape, other)):
                return False
        return set(self.trainable_keys(inner)) <= set(self.trainable_keys(outer))

    def extract(
        self,
        global_state: Mapping[str, torch.Tensor],
        spec: SubmodelSpec | None = None,
        keys: Iterable[str] | None = None,
        *,
        views: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Contiguous cloned slices of ``global_state`` for ``spec`` (``views``: the slices as views, no copy, for a
        reader that neither keeps nor writes them).

        Parameters
        ----------
        global_state:
            Full-width tensors (e.g. ``build(global_spec).state_dict()``); only the keys requested are read.
        spec:
            The sub-model (``None`` = full).
        keys:
            Keys to extract (default: every key of ``index_map(spec)``); e.g. ``state_keys(spec)``.
        """
        spec = self.validate_spec(spec)
        imap = self.index_map(spec)
        gather = spec.roll != 0  # a rolled window is gathered (a copy); leading prefixes are views
        wanted = list(imap) if keys is None else list(keys)
        gshapes = self.global_shapes()
        out: dict[str, torch.Tensor] = {}
        for key in wanted:
            if key not in imap:
                raise ValueError(f"{key!r} is not a state_dict key of this sub-model of family {self.name!r}.")
            if key not in global_state:
                raise ValueError(f"the global state has no tensor {key!r}, which family {self.name!r} needs.")
            tensor = global_state[key].detach()
            if tuple(tensor.shape) != gshapes[key]:
                raise ValueError(
                    f"global tensor {key!r} has shape {tuple(tensor.shape)}, but family {self.name!r} with "
                    f"these options expects {gshapes[key]}."
                )
            for dim, idx in enumerate(imap[key]):
                tensor = tensor.index_select(dim, idx) if gather else tensor.narrow(dim, 0, idx.numel())
            out[key] = tensor if views else tensor.clone(memory_format=torch.contiguous_format)
        return out

    # ------------------------------------------------------------------ costs
    def param_count(self, spec: SubmodelSpec | None = None) -> int:
        """Parameters of the sub-model (every tensor of ``state_keys(spec)``, frozen blocks included)."""
        return sum(math.prod(shape) for shape in self.shapes(spec, track_bn_stats=False).values())

    def check_input(self, input_size: tuple[int, int]) -> None:
        """Raise ValueError ("input_size ... does not fit family ...") when the model cannot take inputs of
        ``input_size`` (a forward pass on the meta device, once per size)."""
        self._spatial(check_input_size(input_size))

    def _spatial(self, input_size: tuple[int, int]) -> dict[str, int]:
        """Output positions (height x width) of every conv and linear layer for one input of ``input_size``:
        one forward pass of the full model with an exit at every exit point, on the meta device."""
        cached = self._spatial_cache.get(input_size)
        if cached is not None:
            return cached
        with torch.device("meta"):
            model = self.build(SubmodelSpec(exits=self._exit_points), track_bn_stats=True).eval()
        positions: dict[str, int] = {}
        names = {module: name for name, module in model.named_modules()}

        def hook(module: nn.Module, _inputs: tuple[Any, ...], output: Any) -> None:
            shape = output.shape
            positions[names[module]] = math.prod(shape[2:]) if len(shape) > 2 else 1

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        try:
            with torch.no_grad():
                model.forward_exits(torch.empty(1, self.in_channels, *input_size, device="meta"))
        except RuntimeError as exc:
            raise ValueError(
                f"input_size {input_size} does not fit family {self.name!r}: {exc}".splitlines()[0]
            ) from None
        finally:
            for h in handles:
                h.remove()
        self._spatial_cache[input_size] = positions
        return positions

    def layer_costs(self, spec: SubmodelSpec | None = None, input_size: tuple[int, int] | None = None
                    ) -> list[tuple[LayerDecl, int, int]]:
        """``(layer, parameters, multiply-accumulates)`` of every layer of ``spec``, in declaration order.

        Multiply-accumulates count one forward pass of one sample (0 for batch norms, and for every layer when
        ``input_size`` is None); see :meth:`flops`. Split searches sum these per block.
        """
        spec = self.validate_spec(spec)
        positions = self._spatial(check_input_size(input_size)) if input_size is not None else None
        shapes = self.shapes(spec, track_bn_stats=False)
        costs: list[tuple[LayerDecl, int, int]] = []
        for d in self._spec_layers(spec):
            params = math.prod(shapes[f"{d.name}.weight"]) + (math.prod(shapes[f"{d.name}.bias"])
                                                               if f"{d.name}.bias" in shapes else 0)
            macs = 0
            if positions is not None and d.kind != "bn":
                macs = positions[d.name] * math.prod(shapes[f"{d.name}.weight"])
            costs.append((d, params, macs))
        return costs

    def flops(self, spec: SubmodelSpec | None = None, input_size: tuple[int, int] = (28, 28)) -> int:
        """Forward multiply-accumulates of the conv and linear layers of ``spec`` for one sample, every output
        (exit) included; biases not counted. One multiply-add counts as one (thop's convention).

        Computed from the declaration: each layer's kept input and output channels times its kernel times the
        output positions, which one meta-device forward pass of the full model measures once per input size.

        For reference: HeteroFL's reference-code PreResNet18 (``blocks=(1, 1, 1, 2)``) gives 328.9 M here
        against 330.2 M in the paper's CIFAR-10 table; for the MNIST conv model the paper lists 80.5 M, about
        twice the 40.0 M multiply-accumulates counted here (parameter counts match that table exactly); ResNet-110
        gives 253.1 M at 32x32, as ScaleFL's Table 1.
        """
        return sum(macs for _, _, macs in self.layer_costs(spec, input_size))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        extra = f", {opts}" if opts else ""
        return f"{type(self).__name__}(num_classes={self.num_classes}, in_channels={self.in_channels}{extra})"


def _ranges(values: Sequence[int]) -> str:
    """``0..4, 7`` for (0, 1, 2, 3, 4, 7)."""
    parts: list[str] = []
    items = sorted(values)
    start = prev = items[0] if items else 0
    for v in items[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}..{prev}" if prev > start else f"{start}")
        if v is not None:
            start = prev = v
    return ", ".join(parts) if items else "none"
