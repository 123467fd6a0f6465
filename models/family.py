"""The model-family base class: one place for index maps, slicing and cost estimates.

A concrete family only *declares* its architecture:

- ``_channel_groups()``: the named channel dimensions that can be narrowed (the names ``layer_widths`` may
  use) with their global sizes. Layers that must agree on a width (e.g. every layer writing to one residual
  stream) share one group.
- ``_declare_layers()``: one :class:`LayerDecl` per module that owns state, in module registration order, saying
  which group feeds it and which group it produces.
- ``_build_module()``: the ``nn.Module`` at given channel counts and Scaler rates.

Everything else (index maps, extraction, key lists, parameter counts, FLOPs, memory) follows from the
declaration here, so a new family cannot get the slicing rules subtly different from the others. Tests check
that the declaration matches the built module's ``state_dict`` key for key and shape for shape.

Slicing rule (HeteroFL, and the default of every method FedFit implements): each dimension keeps the leading
prefix of the global dimension; a layer's input indices are its input group's kept indices; the model input
channels and the classifier's class rows are never sliced. Because ``scaled_channels`` is monotone in the rate,
a smaller spec is nested inside a larger one.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from models.spec import SubmodelSpec
from models.width import scaled_channels

if TYPE_CHECKING:
    from models.memory import MemoryEstimate

__all__ = ["BYTES_PER_ELEMENT", "LayerDecl", "ModelFamily", "bn_decl", "conv_decl", "linear_decl"]

#: Bytes per element of every tensor FedFit trains (float32).
BYTES_PER_ELEMENT = 4

LayerKind = Literal["conv", "bn", "linear"]

_SPEC_FEATURES = ("depth", "exits", "trainable_blocks")


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
        Channel group the layer produces; ``None`` = the classes (never sliced; the classifier).
    kernel:
        Spatial kernel size of a conv.
    bias:
        Whether a conv or linear layer has a bias.
    block:
        Body block the layer belongs to (0-based), or ``None`` for the stem and the head.
    """

    name: str
    kind: LayerKind
    in_group: str | None
    out_group: str | None
    kernel: tuple[int, ...] = ()
    bias: bool = True
    block: int | None = None


def conv_decl(
    name: str,
    in_group: str | None,
    out_group: str | None,
    kernel: tuple[int, ...] = (3, 3),
    *,
    bias: bool = True,
    block: int | None = None,
) -> LayerDecl:
    """Declare a convolution."""
    return LayerDecl(name, "conv", in_group, out_group, tuple(kernel), bias, block)


def bn_decl(name: str, group: str, *, block: int | None = None) -> LayerDecl:
    """Declare a (static) batch norm over ``group``."""
    return LayerDecl(name, "bn", group, group, (), True, block)


def linear_decl(
    name: str,
    in_group: str | None,
    out_group: str | None = None,
    *,
    bias: bool = True,
    block: int | None = None,
) -> LayerDecl:
    """Declare a linear layer (``out_group=None``: the classifier)."""
    return LayerDecl(name, "linear", in_group, out_group, (), bias, block)


def _check_positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


def positive_int_tuple(what: str, value: object) -> tuple[int, ...]:
    """Validate a non-empty sequence of positive integers (e.g. a ``hidden`` option) and return it as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{what} must be a non-empty sequence of positive integers, got {value!r}.")
    return tuple(_check_positive_int(f"every entry of {what}", v) for v in value)


def _check_input_size(input_size: object) -> tuple[int, int]:
    if (
        not isinstance(input_size, (tuple, list))
        or len(input_size) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in input_size)
    ):
        raise ValueError(f"input_size must be (height, width) with positive integers, got {input_size!r}.")
    return int(input_size[0]), int(input_size[1])


@dataclass(frozen=True)
class _Trace:
    """What one batch-1 forward pass measured."""

    macs: int
    activation_elements: int


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
    """

    #: Registry name of the family.
    name: ClassVar[str] = ""
    #: Options the family accepts, with their defaults.
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: Spec features beyond width the family implements (a subset of depth, exits, trainable_blocks).
    supported_features: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, num_classes: int, in_channels: int, **options: Any) -> None:
        self.num_classes = _check_positive_int("num_classes", num_classes)
        self.in_channels = _check_positive_int("in_channels", in_channels)
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            valid = ", ".join(sorted(self.option_defaults)) or "none"
            raise ValueError(
                f"unknown option {unknown[0]!r} for model family {self.name!r}; valid options: {valid}."
            )
        merged = {**self.option_defaults, **options}
        self.options: dict[str, Any] = self._validate_options(merged)
        self._groups: dict[str, int] = dict(self._channel_groups())
        self._layers: tuple[LayerDecl, ...] = tuple(self._declare_layers())
        self._check_declaration()
        self._trace_cache: dict[tuple[SubmodelSpec, tuple[int, int]], _Trace] = {}

    # ------------------------------------------------------------------ what a family declares
    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise the merged options; override in families with options."""
        return options

    @abc.abstractmethod
    def _channel_groups(self) -> Mapping[str, int]:
        """Named channel groups (the layer names of ``layer_widths``) and their global sizes, in order."""

    @abc.abstractmethod
    def _declare_layers(self) -> Sequence[LayerDecl]:
        """Every module that owns state, in registration (``state_dict``) order."""

    @abc.abstractmethod
    def _build_module(
        self, channels: Mapping[str, int], rates: Mapping[str, float], track_bn_stats: bool
    ) -> nn.Module:
        """Build the network with ``channels[group]`` channels and Scaler rate ``rates[group]`` per group."""

    # ------------------------------------------------------------------ declaration checks
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
        if len(self.classifier_keys()) == 0:
            raise ValueError(f"family {self.name!r} declares no classifier (a layer with out_group=None).")

    # ------------------------------------------------------------------ spec handling
    def layer_names(self) -> tuple[str, ...]:
        """Names that ``SubmodelSpec.layer_widths`` may use for this family."""
        return tuple(self._groups)

    def layers(self) -> tuple[LayerDecl, ...]:
        """The declared stateful layers, in ``state_dict`` order."""
        return self._layers

    def validate_spec(self, spec: SubmodelSpec | None = None) -> SubmodelSpec:
        """Return ``spec`` (``None`` -> full) after checking it fits this family.

        Raises
        ------
        ValueError
            For a layer name the family does not have, or a spec feature it does not implement yet.
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
        for feature in _SPEC_FEATURES:
            value = getattr(spec, feature)
            is_set = value is not None if feature != "exits" else bool(value)
            if is_set and feature not in self.supported_features:
                raise ValueError(f"{feature} is not supported by family {self.name!r} yet.")
        return spec

    def kept_channels(self, spec: SubmodelSpec | None = None) -> dict[str, int]:
        """Channels each group keeps under ``spec`` (``ceil(rate * global)``)."""
        spec = self.validate_spec(spec)
        return {g: scaled_channels(c, spec.rate_for(g)) for g, c in self._groups.items()}

    def _rates(self, spec: SubmodelSpec) -> dict[str, float]:
        return {g: spec.rate_for(g) for g in self._groups}

    # ------------------------------------------------------------------ building
    def build(self, spec: SubmodelSpec | None = None, *, track_bn_stats: bool = True) -> nn.Module:
        """Build the sub-model for ``spec`` (``None`` = the full model), in train mode.

        ``track_bn_stats=False`` is what the edge trains (static BN: batch statistics only, no running buffers
        in the ``state_dict``); ``True`` is what the server evaluates (cumulative running statistics).
        """
        spec = self.validate_spec(spec)
        return self._build_module(self.kept_channels(spec), self._rates(spec), track_bn_stats)

    # ------------------------------------------------------------------ index maps and slicing
    def _group_size(self, group: str | None, channels: Mapping[str, int], *, is_input: bool) -> int:
        if group is None:
            return self.in_channels if is_input else self.num_classes
        return channels[group]

    def _shapes(self, channels: Mapping[str, int], track_bn_stats: bool) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for d in self._layers:
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
        """Shape of every ``state_dict`` tensor of the full model built with ``track_bn_stats=True``."""
        return self._shapes(self._groups, True)

    def index_map(self, spec: SubmodelSpec | None = None) -> dict[str, tuple[torch.Tensor, ...]]:
        """Positions in the global tensors of every ``state_dict`` tensor of ``build(spec)``.

        For each key, one int64 index tensor per dimension, so that
        ``global[key][torch.meshgrid(*idx, indexing="ij")]`` has the sub-model's shape. Scalars
        (``num_batches_tracked``) map to ``()``. All indices are leading prefixes (see the module docstring).
        """
        shapes = self._shapes(self.kept_channels(spec), True)
        return {
            key: tuple(torch.arange(n, dtype=torch.int64) for n in shape) for key, shape in shapes.items()
        }

    def trainable_keys(self, spec: SubmodelSpec | None = None) -> tuple[str, ...]:
        """``state_dict`` keys of ``build(spec, track_bn_stats=False)``: what travels to and from clients."""
        return tuple(self._shapes(self.kept_channels(spec), False))

    def classifier_keys(self) -> tuple[str, ...]:
        """Keys of the final classifier whose dim 0 is the class dimension (weight, and bias if any)."""
        keys: list[str] = []
        for d in self._layers:
            if d.out_group is None:
                keys.append(f"{d.name}.weight")
                if d.bias:
                    keys.append(f"{d.name}.bias")
        return tuple(keys)

    def extract(
        self,
        global_state: Mapping[str, torch.Tensor],
        spec: SubmodelSpec | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Contiguous cloned slices of ``global_state`` for ``spec``.

        Parameters
        ----------
        global_state:
            Full-model tensors (e.g. ``build().state_dict()``); only the keys requested are read.
        spec:
            The sub-model (``None`` = full).
        keys:
            Keys to extract (default: every key of ``index_map(spec)``); e.g. ``trainable_keys(spec)``.
        """
        imap = self.index_map(spec)
        wanted = list(imap) if keys is None else list(keys)
        gshapes = self.global_shapes()
        out: dict[str, torch.Tensor] = {}
        for key in wanted:
            if key not in imap:
                raise ValueError(f"{key!r} is not a state_dict key of family {self.name!r}.")
            if key not in global_state:
                raise ValueError(f"the global state has no tensor {key!r}, which family {self.name!r} needs.")
            tensor = global_state[key].detach()
            if tuple(tensor.shape) != gshapes[key]:
                raise ValueError(
                    f"global tensor {key!r} has shape {tuple(tensor.shape)}, but family {self.name!r} with "
                    f"these options expects {gshapes[key]}."
                )
            for dim, idx in enumerate(imap[key]):
                n = idx.numel()
                if n and int(idx[0]) == 0 and torch.equal(idx, torch.arange(n, dtype=idx.dtype)):
                    tensor = tensor.narrow(dim, 0, n)
                else:
                    tensor = tensor.index_select(dim, idx.to(tensor.device))
            out[key] = tensor.clone(memory_format=torch.contiguous_format)
        return out

    # ------------------------------------------------------------------ costs
    def param_count(self, spec: SubmodelSpec | None = None) -> int:
        """Trainable parameters of the sub-model (the tensors of ``trainable_keys(spec)``)."""
        shapes = self._shapes(self.kept_channels(spec), False)
        return sum(math.prod(shape) for shape in shapes.values())

    def _trace(self, spec: SubmodelSpec, input_size: tuple[int, int]) -> _Trace:
        cache_key = (spec, input_size)
        cached = self._trace_cache.get(cache_key)
        if cached is not None:
            return cached
        # Eval mode with running statistics: shapes equal training's, and BN works on a single sample even
        # where the feature map is 1x1 (batch statistics would need more than one value per channel).
        model = self.build(spec, track_bn_stats=True).eval()
        macs = 0
        elements = 0

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            nonlocal macs, elements
            outs = output if isinstance(output, (tuple, list)) else (output,)
            tensors = [o for o in outs if isinstance(o, torch.Tensor)]
            elements += sum(t.numel() for t in tensors)
            if isinstance(module, nn.Conv2d):
                per_output = (module.in_channels // module.groups) * math.prod(module.kernel_size)
                macs += tensors[0].numel() * per_output
            elif isinstance(module, nn.Linear):
                macs += tensors[0].numel() * module.in_features

        handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                model(torch.zeros(1, self.in_channels, *input_size))
        except RuntimeError as exc:
            raise ValueError(
                f"input_size {input_size} does not fit family {self.name!r}: {exc}".splitlines()[0]
            ) from None
        finally:
            for h in handles:
                h.remove()
        trace = _Trace(macs=macs, activation_elements=elements)
        self._trace_cache[cache_key] = trace
        return trace

    def flops(self, spec: SubmodelSpec | None = None, input_size: tuple[int, int] = (28, 28)) -> int:
        """Forward multiply-accumulates of conv and linear layers for one sample (biases not counted).

        One multiply-add counts as one (thop's convention). Measured with forward hooks on a real batch-1
        forward pass in eval mode; cached per (spec, input_size).

        For reference: HeteroFL's reference-code PreResNet18 (``blocks=(1, 1, 1, 2)``) gives 328.9 M here
        against 330.2 M in the paper's CIFAR-10 table; for the MNIST conv model the paper lists 80.5 M, about
        twice the 40.0 M multiply-accumulates counted here (parameter counts match that table exactly).
        """
        spec = self.validate_spec(spec)
        return self._trace(spec, _check_input_size(input_size)).macs

    def training_memory_estimate(
        self,
        spec: SubmodelSpec | None = None,
        *,
        batch_size: int,
        input_size: tuple[int, int] = (28, 28),
        optimizer_slots: int = 1,
        device: str = "cpu",
        allocator: str = "compact",
    ) -> MemoryEstimate:
        """Estimated peak memory of training ``spec``, with its parts (see :mod:`models.memory`).

        ``optimizer_slots`` is the number of state tensors per parameter (SGD with momentum 1, without 0, Adam 2);
        ``device`` is ``"cpu"`` (process RSS above the training process's baseline) or ``"cuda"`` (the caching
        allocator's peak; the CUDA context is not counted). Computed by shape propagation on the meta device,
        cached per arguments. ``allocator`` (CPU only) is how the training process's heap is managed:
        ``"compact"`` (``edge_agent.allocator``) or glibc's ``"default"``.
        """
        from models.memory import estimate_training_memory

        return estimate_training_memory(
            self,
            spec,
            batch_size=batch_size,
            input_size=input_size,
            optimizer_slots=optimizer_slots,
            device=device,
            allocator=allocator,
        )

    def training_memory_bytes(
        self,
        spec: SubmodelSpec | None = None,
        *,
        batch_size: int,
        input_size: tuple[int, int] = (28, 28),
        optimizer_slots: int = 1,
        device: str = "cpu",
        allocator: str = "compact",
    ) -> int:
        """Estimated peak memory of training ``spec``, in bytes: ``training_memory_estimate(...).total``."""
        return self.training_memory_estimate(
            spec,
            batch_size=batch_size,
            input_size=input_size,
            optimizer_slots=optimizer_slots,
            device=device,
            allocator=allocator,
        ).total

    def num_blocks(self, spec: SubmodelSpec | None = None) -> int:
        """Number of body blocks depth-wise training trains one at a time (see ``models.memory.split_blocks``)."""
        from models.memory import num_blocks

        return num_blocks(self, self.validate_spec(spec))

    def block_training_memory_estimate(
        self,
        spec: SubmodelSpec | None,
        block: int,
        *,
        batch_size: int,
        input_size: tuple[int, int] = (28, 28),
        optimizer_slots: int = 1,
        device: str = "cpu",
        allocator: str = "compact",
    ) -> MemoryEstimate:
        """Estimated peak memory of training body block ``block`` and the head of ``spec`` (FeDepth).

        Blocks before ``block`` are frozen (no gradients, no optimizer state, run without autograd so only their
        output exists), later blocks are skipped (see :class:`models.memory.BlockTrainingModel`). All parameters
        of ``spec`` are in memory.
        """
        from models.memory import estimate_training_memory

        count = self.num_blocks(spec)
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < count:
            raise ValueError(
                f"block must be an integer in 0..{count - 1} for family {self.name!r}, got {block!r}."
            )
        return estimate_training_memory(
            self,
            spec,
            batch_size=batch_size,
            input_size=input_size,
            optimizer_slots=optimizer_slots,
            device=device,
            block=block,
            allocator=allocator,
        )

    def block_training_memory_bytes(
        self,
        spec: SubmodelSpec | None,
        block: int,
        *,
        batch_size: int,
        input_size: tuple[int, int] = (28, 28),
        optimizer_slots: int = 1,
        device: str = "cpu",
        allocator: str = "compact",
    ) -> int:
        """Estimated peak bytes of training only body block ``block`` and the head: the estimate's ``total``."""
        return self.block_training_memory_estimate(
            spec,
            block,
            batch_size=batch_size,
            input_size=input_size,
            optimizer_slots=optimizer_slots,
            device=device,
            allocator=allocator,
        ).total

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        extra = f", {opts}" if opts else ""
        return f"{type(self).__name__}(num_classes={self.num_classes}, in_channels={self.in_channels}{extra})"
