"""Coordinator configuration (YAML, validated by :func:`common.config.from_mapping`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from common.mqtt_link import BrokerConfig
from models import FAMILY_NAMES
from protocol import validate_name
from protocol.plan import MAX_COPIES, MAX_WIDTHS, ROUTES

HETEROFL_RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)


@dataclass
class ModelConfig:
    """The global model: a family from ``models.FAMILY_NAMES`` and its options (e.g. ``hidden``)."""

    family: str = "cnn"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Server-side data: the held-out test set and a sample for static-BN statistics."""

    dataset: str = "auto"
    root: str | None = None
    bn_samples: int = 5000
    eval_samples: int | None = None


@dataclass
class RecipeConfig:
    """Local training hyperparameters sent to every agent with its task.

    ``masked_ce``: HeteroFL's masked cross-entropy (the logits of classes absent from a device's data are set to 0;
    a no-op where a device holds every class). Left out (null), each method follows its paper: on for HeteroFL,
    off for the others; true or false applies it to every method.
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float | None = 1.0
    masked_ce: bool | None = None

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.epochs < 1 or self.batch_size < 2:
            raise ValueError("recipe.epochs must be at least 1 and recipe.batch_size at least 2 (static BN "
                             "normalises with batch statistics)")
        if not self.lr > 0 or not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"recipe.lr must be positive, recipe.momentum in [0, 1) and recipe.weight_decay "
                             f"non-negative, got {self.lr}, {self.momentum} and {self.weight_decay}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"recipe.clip_norm must be positive or null, got {self.clip_norm}")


#: ScaleFL's default cost ratios (four levels, as in ALGORITHMS.md): ``scalefl.ratios`` where the fleet is not known.
SCALEFL_RATIOS = (0.125, 0.25, 0.5, 1.0)


@dataclass
class ScaleFLConfig:
    """ScaleFL's settings (the ``scalefl`` section; used when ``algorithm: scalefl``).

    ``ratios``: target cost ratios r_l of the levels, smallest first, the last 1 (the full model), or ``auto``
    (the default): one level per cluster of the budgets the fleet reports at its first round (each at the share
    of the full model's ``memory`` cost its devices can train, at most four below the full model), so that the
    weakest devices have a level; before the fleet is known (``fedfit plan`` without budgets), where every device
    can train the top level, and with ``cost`` ``params``/``flops`` the fixed :data:`SCALEFL_RATIOS`.
    ``cost``: what a level's cost counts: ``memory`` (its estimated training memory at the recipe's batch size,
    what the budgets agents report limit), ``params`` or ``flops`` (per sample, at the dataset's image size; the
    paper's two, for comparing with its Table 1).
    ``tolerance``: eps_l, one for all levels or one per level. ``grid_step``: step of the s_d, s_w grid search.
    ``tau``, ``beta``: the self-distillation temperature and weight of Eq. 5 (paper: 3 and 0.1 for vision).
    ``kd_warmup``: share of the rounds trained without distillation (reference code: 0.25; paper: 0).
    ``detach_teacher``: stop the distillation gradient through the last exit (reference code: no).
    ``normalization``: the weights of Eq. 5, ``reference`` (the default: ``2 i / (l (l + 1))``, summing to 1 as
    in the reference code, so a level-``l`` device steps as far as any other device at the same learning rate) or
    ``paper`` (Eq. 5 as printed, ``i / (l (l + 1))``: the weights sum to 1/2, halving every ScaleFL step).
    """

    ratios: list[float] | Literal["auto"] = "auto"
    cost: Literal["memory", "params", "flops"] = "memory"
    tolerance: float | list[float] = 0.1
    grid_step: float = 0.01
    tau: float = 3.0
    beta: float = 0.1
    kd_warmup: float = 0.0
    detach_teacher: bool = False
    normalization: Literal["paper", "reference"] = "reference"

    def fixed_ratios(self) -> list[float]:
        """The configured ratios, or :data:`SCALEFL_RATIOS` where they are ``auto`` (before the fleet is known)."""
        return list(SCALEFL_RATIOS) if self.ratios == "auto" else list(self.ratios)

    def tolerances(self) -> list[float]:
        """eps_l for every level of :meth:`fixed_ratios`."""
        if isinstance(self.tolerance, list):
            return list(self.tolerance)
        return [self.tolerance] * len(self.fixed_ratios())

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.ratios, str) and self.ratios != "auto":
            raise ValueError(f"scalefl.ratios must be auto or a list of ratios, got {self.ratios!r}")
        if self.ratios == "auto" and isinstance(self.tolerance, list):
            raise ValueError("scalefl.tolerance must be one number with scalefl.ratios: auto (the levels come from "
                             "the fleet)")
        ratios = self.fixed_ratios()
        if (not ratios or any(not 0 < r <= 1 for r in ratios)
                or any(a >= b for a, b in itertools.pairwise(ratios)) or ratios[-1] != 1.0):
            raise ValueError(f"scalefl.ratios must increase strictly within (0, 1] and end with 1, got {ratios}")
        tolerances = self.tolerances()
        if len(tolerances) != len(ratios) or any(t < 0 for t in tolerances):
            raise ValueError("scalefl.tolerance must be one non-negative number or one per level")
        if not 0 < self.grid_step <= 0.5:
            raise ValueError(f"scalefl.grid_step must be in (0, 0.5], got {self.grid_step}")
        if self.tau <= 0 or self.beta < 0 or not 0 <= self.kd_warmup < 1:
            raise ValueError("scalefl.tau must be positive, scalefl.beta non-negative, scalefl.kd_warmup in [0, 1)")


@dataclass
class FeDepthConfig:
    """FeDepth's settings (the ``fedepth`` section; used when ``algorithm: fedepth``).

    ``max_copies``: the most copies a device with memory to spare trains with mutual distillation
    (m-FeDepth; 1 switches it off). ``mutual_weight``: the weight of the mutual KL terms. ``route``: how a
    depth-wise segment's output reaches a classifier, ``skip`` (the paper's skip connection to the final head) or
    ``exit`` (an auxiliary classifier after every block, the model's early-exit heads: ``model.options.exit_convs``
    sets their size). ``min_micro_batch``: a block that a device cannot train alone at the recipe's batch size
    trains in micro-batches (the batch halved until it fits, gradients accumulated up to the batch) of no fewer
    samples than this; below it the block is skipped (partial training). 0: no micro-batches.
    """

    max_copies: int = 2
    mutual_weight: float = 1.0
    route: str = "skip"
    min_micro_batch: int = 8

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not 1 <= self.max_copies <= MAX_COPIES or self.mutual_weight < 0:
            raise ValueError(f"fedepth.max_copies must be between 1 and {MAX_COPIES} and fedepth.mutual_weight "
                             "non-negative")
        if self.min_micro_batch == 1 or self.min_micro_batch < 0:
            raise ValueError(f"fedepth.min_micro_batch must be 0 (no micro-batches) or at least 2 (batch "
                             f"normalisation needs two samples), got {self.min_micro_batch}")
        if self.route not in ROUTES:
            raise ValueError(f"fedepth.route must be one of {', '.join(ROUTES)}, got {self.route!r}")


#: FlexFL's default pool ratios (the reference code's 0.25 and 0.5 of the full model): ``flexfl.ratios`` where
#: the fleet is not known.
FLEXFL_RATIOS = (0.25, 0.5, 1.0)


@dataclass
class FlexFLConfig:
    """FlexFL's settings (the ``flexfl`` section; used when ``algorithm: flexfl``).

    Pre-processing (once, at set-up): ``proxy_fraction`` of the server's training split (never the test split) is
    the proxy set, ``proxy_train`` of it pre-trains the global model for ``pretrain_rounds`` rounds and the rest
    scores APoZ. One pre-training round is one pass over the proxy set's training part with the recipe's optimizer
    and batch size (the reference code's ``--pretrain`` rounds: one pass over its proxy training split each); the
    paper trains "for 100 rounds" before scoring, the default 5 is shorter so that the set-up stays affordable on a
    small server (about 10 s a round for the default CNN on Fashion-MNIST's 1% proxy set on 2 CPU cores): a
    deviation, ``pretrain_rounds: 100`` is the paper's. ``apoz_at``: APoZ is the fraction of zeros ``after_relu``
    (the paper's Eq. 2) or, an option, of the values a ReLU would zero ``before_bn`` (per channel, at the input of
    the layer's batch norm; see :mod:`models.pruning`). ``init``: the initial global model is a fresh one
    (``fresh``, the paper: Alg. 2 resets the global model after scoring) or the pre-trained one (``pretrained``).
    Algorithm 1: ``ratios`` (L_p, smallest first, the last 1: the full model; ``auto``, the default with ``size:
    memory``: one pool model per cluster of the budgets the fleet reports at its first round, each just below the
    share its devices can train, at most four below the full model, so that the weakest devices have one; before
    the fleet is known, where every device can train the full model, and with another ``size``,
    :data:`FLEXFL_RATIOS`; an adaptive variant that would not lie
    between its pool model and the next smaller one is left out) of ``size`` (``memory``, the default:
    the model-dependent part of the estimated training memory at the recipe's batch size, the unit of the budgets
    devices report, as ScaleFL's ``cost: memory``; ``params``: all parameters, the paper's unit; ``features``: all
    but the final classifier's, the reference code's), gamma on a grid of ``step`` (xi) searched ``up`` from 0 (the
    paper) or ``down`` (the reference), within ``tolerance`` (eps) of each ratio; ``rounding`` of the kept channels
    (``floor``: the reference's ``int(C * s)``). The pool models M2..Mn each have an adaptive variant, by the same
    rule, with ``adaptive_cut`` (Gamma) less ``size``: ``global``, the paper's "Gamma x size(M) parameters ...
    size(M) is the number of parameters of the global model" (a share of the full model's: M2' = 0.5 - 0.1 = 0.4,
    the reference's targets ``0.5 - d``, ``1 - d``), or ``relative`` (a share of the pool model's own: M2' = 0.45).
    The paper lists no M1' (the order of adaptive pruning is "M3', M2, M2', and M1"): ``full_variant: true`` adds
    one. The coordinator sends only the pool models (P = {M1..Mn}); the variants are rungs of a device's ladder.
    Self-KD (Eq. 4): ``kd_weight`` (lambda), ``tau``; ``kd_reduction`` ``batchmean`` (KL summed over classes, the
    paper's) or ``mean`` (the reference's ``KLDivLoss()``, which also averages over the classes).
    """

    proxy_fraction: float = 0.01
    proxy_train: float = 0.8
    pretrain_rounds: int = 5
    apoz_at: Literal["after_relu", "before_bn"] = "after_relu"
    init: Literal["fresh", "pretrained"] = "fresh"
    ratios: list[float] | Literal["auto"] = "auto"
    size: Literal["memory", "params", "features"] = "memory"
    step: float = 0.01
    tolerance: float = 0.01
    search: Literal["up", "down"] = "up"
    rounding: Literal["floor", "ceil"] = "floor"
    adaptive_cut: float = 0.1
    adaptive_mode: Literal["global", "relative"] = "global"
    full_variant: bool = False
    kd_weight: float = 10.0
    tau: float = 3.0
    kd_reduction: Literal["batchmean", "mean"] = "batchmean"

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.ratios, str) and self.ratios != "auto":
            raise ValueError(f"flexfl.ratios must be auto or a list of ratios, got {self.ratios!r}")
        ratios = self.fixed_ratios()
        if (not ratios or any(not 0 < r <= 1 for r in ratios)
                or any(a >= b for a, b in itertools.pairwise(ratios)) or ratios[-1] != 1.0):
            raise ValueError(f"flexfl.ratios must increase strictly within (0, 1] and end with 1, got {ratios}")
        if not 0 < self.proxy_fraction <= 1 or not 0 < self.proxy_train < 1:
            raise ValueError("flexfl.proxy_fraction must be in (0, 1] and flexfl.proxy_train in (0, 1)")
        if self.pretrain_rounds < 0:
            raise ValueError(f"flexfl.pretrain_rounds must be non-negative, got {self.pretrain_rounds}")
        if not 0.0001 <= self.step <= 0.5 or not 0 <= self.tolerance < 0.5:
            raise ValueError("flexfl.step must be in [0.0001, 0.5] and flexfl.tolerance in [0, 0.5)")
        if not 0 <= self.adaptive_cut < 1:
            raise ValueError(f"flexfl.adaptive_cut must be in [0, 1), got {self.adaptive_cut}")
        if self.adaptive_cut > 0:
            cut = (f"{self.adaptive_cut} of the full model's size (global)" if self.adaptive_mode == "global"
                   else f"{self.adaptive_cut} of each pool model's own size (relative)")
            for below, ratio in zip([0.0, *ratios], ratios):
                if below == 0.0 and not self.full_variant:
                    continue  # no M1' (the paper's pool)
                if not below < self.adaptive_target(ratio) < ratio:
                    raise ValueError(f"flexfl.adaptive_cut {cut} puts the adaptive variant of the pool model of "
                                     f"{ratio} at {self.adaptive_target(ratio):.3g}, outside the gap to the next "
                                     f"smaller pool model ({below}): Gamma must be smaller than that gap")
        if self.kd_weight < 0 or self.tau <= 0:
            raise ValueError("flexfl.kd_weight must be non-negative and flexfl.tau positive")

    def adaptive_target(self, ratio: float) -> float:
        """The share of the full model's ``size`` an adaptive variant of the pool model of ``ratio`` keeps:
        ``ratio - Gamma`` (``global``, the paper) or ``ratio * (1 - Gamma)`` (``relative``)."""
        return ratio * (1 - self.adaptive_cut) if self.adaptive_mode == "relative" else ratio - self.adaptive_cut

    def fixed_ratios(self) -> list[float]:
        """The configured ratios, or :data:`FLEXFL_RATIOS` where they are ``auto`` (before the fleet is known)."""
        return list(FLEXFL_RATIOS) if self.ratios == "auto" else list(self.ratios)

    def has_variant(self, number: int) -> bool:
        """Whether the pool model ``M{number}`` (1: the smallest) has an adaptive variant."""
        return self.adaptive_cut > 0 and (number > 1 or self.full_variant)


#: AdaptiveFL's widths r_w of the L, M and S types (the paper's Table 1): ``adaptivefl.widths`` where the fleet is
#: not known.
ADAPTIVEFL_WIDTHS = (1.0, 0.66, 0.4)


@dataclass
class AdaptiveFLConfig:
    """AdaptiveFL's settings (the ``adaptivefl`` section; used when ``algorithm: adaptivefl``).

    The pool (the paper's Table 1): one model per width in ``widths`` (largest first; the first is type L, then M,
    S, XS, XXS) and value of I in ``full_layers`` (largest first; null: the family's default, VGG-16's 8, 6, 4, see
    :func:`models.fine_grained.default_full_layers`); a width of 1 is the full model alone. ``widths: auto`` (the
    default): the paper's 1, 0.66, 0.4 (:data:`ADAPTIVEFL_WIDTHS`), the S type's narrowed, when the fleet reports its
    budgets at its first round, to the widest that its weakest devices can train (its smallest model, at the
    smallest I); where none can, the plan says so with what the smallest would need. No I may be below
    ``min_full_layers``: the shallow layers are never pruned. ``selection``: ``rl`` (Algorithm 1: the resource
    reward capped at ``success_cap`` times the curiosity reward), or the paper's ablations ``greedy`` (the largest
    model to random clients), ``random`` (a random model to a random client), ``curiosity`` (the curiosity reward
    alone) and ``resource`` (the resource reward alone).

    ``readmit_after`` (K, default 5; not in the paper): a client whose every resource-table score has fallen to 0
    (e.g. after one decline for memory) has reward 0 and, by the paper's rule, is never drawn again; after K rounds
    out its resource table is reset to the initial 1s, so no device is kept out of the draws for more than K
    rounds. 0 or null: never (the paper's strict rule). Why 5: by then the evidence that zeroed the table is stale
    when resources fluctuate, and a device that still cannot train costs at most one declined task per K + 1 rounds.
    ``large_divisor``: ``paper`` (default; the paper's formula divides R_s by p for every type, L included) or
    ``reference`` (the reference code divides the L type's share by 1, its one model); they differ only in how the
    L type's R_s meets ``success_cap`` (see :mod:`coordinator.client_selection`).
    """

    widths: list[float] | Literal["auto"] = "auto"
    full_layers: list[int] | None = None
    min_full_layers: int = 1
    selection: Literal["rl", "greedy", "random", "curiosity", "resource"] = "rl"
    success_cap: float = 0.5
    readmit_after: int | None = 5
    large_divisor: Literal["paper", "reference"] = "paper"

    def fixed_widths(self) -> list[float]:
        """The configured widths, or :data:`ADAPTIVEFL_WIDTHS` where they are ``auto`` (before the fleet is known)."""
        return list(ADAPTIVEFL_WIDTHS) if self.widths == "auto" else list(self.widths)

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if isinstance(self.widths, str) and self.widths != "auto":
            raise ValueError(f"adaptivefl.widths must be auto or a list of widths, got {self.widths!r}")
        widths = self.fixed_widths()
        if (not widths or len(widths) > 5 or any(not 0 < w <= 1 for w in widths)
                or any(a <= b for a, b in itertools.pairwise(widths))):
            raise ValueError(f"adaptivefl.widths must be 1 to 5 widths in (0, 1], strictly decreasing, got {widths}")
        if self.min_full_layers < 0:
            raise ValueError(f"adaptivefl.min_full_layers must be non-negative, got {self.min_full_layers}")
        layers = self.full_layers
        if layers is not None and (not layers or any(a <= b for a, b in itertools.pairwise(layers))
                                   or min(layers) < self.min_full_layers):
            raise ValueError(f"adaptivefl.full_layers must be strictly decreasing values of I, none below "
                             f"adaptivefl.min_full_layers ({self.min_full_layers}), got {layers}")
        if self.selection not in ("rl", "greedy", "random", "curiosity", "resource"):
            raise ValueError("adaptivefl.selection must be one of rl, greedy, random, curiosity, resource, got "
                             f"{self.selection!r}")
        if not 0 < self.success_cap <= 1:
            raise ValueError(f"adaptivefl.success_cap must be in (0, 1], got {self.success_cap}")
        if self.readmit_after is not None and self.readmit_after < 0:
            raise ValueError("adaptivefl.readmit_after must be a number of rounds, 0 or null (never: the paper's "
                             f"rule), got {self.readmit_after}")
        if self.large_divisor not in ("paper", "reference"):
            raise ValueError(f"adaptivefl.large_divisor must be paper or reference, got {self.large_divisor!r}")


@dataclass
class FedAvgConfig:
    """FedAvg's setting (the ``fedavg`` section): the uniform ``width`` every device trains (1: the full model,
    the memory-ignoring upper reference; e.g. 1/6: FeDepth's and HeteroFL's "FedAvg (x 1/6)")."""

    width: float = 1.0

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not 0 < self.width <= 1:
            raise ValueError(f"fedavg.width must be in (0, 1], got {self.width}")


@dataclass
class FedRolexConfig:
    """FedRolex's setting (the ``fedrolex`` section): which way the window of channels rolls, one channel a round:
    ``forward`` (the paper: the window of round t starts at channel t mod C) or ``backward`` (the reference
    code's ``torch.roll``: it starts at -t mod C)."""

    direction: Literal["forward", "backward"] = "forward"

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.direction not in ("forward", "backward"):
            raise ValueError(f"fedrolex.direction must be forward or backward, got {self.direction!r}")


@dataclass
class DepthFLConfig:
    """DepthFL's settings (the ``depthfl`` section): ``kd_weight`` (default 1, the paper's mutual distillation;
    0 turns it off: each classifier learns from the labels alone), the weight of the KL terms against the
    cross-entropy ones; ``kd_rampup`` (default 0: none, the paper), rounds over which that weight rises as
    ``exp(-5 (1 - r / R)^2)``, as the reference code does with R = 300; ``tau`` (default 1, the paper's), the
    distillation temperature; ``depths`` (default: the model's stage ends), the blocks each level keeps, shallowest
    first, the last every block (e.g. ``[2, 4, 7, 10, 13]`` for VGG-16's five pooled stages)."""

    kd_weight: float = 1.0
    kd_rampup: int = 0
    tau: float = 1.0
    depths: list[int] | None = None

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not (self.kd_weight >= 0 and math.isfinite(self.kd_weight)):
            raise ValueError(f"depthfl.kd_weight must be a non-negative number, got {self.kd_weight}")
        if self.kd_rampup < 0:
            raise ValueError(f"depthfl.kd_rampup must be a number of rounds (0: none), got {self.kd_rampup}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"depthfl.tau must be positive, got {self.tau}")
        if self.depths is not None and (not self.depths or any(d < 1 for d in self.depths)
                                        or sorted(set(self.depths)) != list(self.depths)):
            raise ValueError(f"depthfl.depths must be increasing block counts, got {self.depths}")


#: FjORD's grid of ordered-dropout widths (the paper's and the reference code's).
FJORD_WIDTHS = (1.0, 0.8, 0.6, 0.4, 0.2)


@dataclass
class FjORDConfig:
    """FjORD's settings (the ``fjord`` section): ``widths``, the grid of uniform widths, largest first (default
    the paper's 1, 0.8, 0.6, 0.4, 0.2: a device's p_max is the widest it affords, and each batch trains a width
    drawn from those up to it); ``distill`` (default true), the paper's D-KD: each batch trains p_max and then the
    drawn width towards p_max's prediction (false: the drawn width alone, on the labels)."""

    widths: list[float] = field(default_factory=lambda: list(FJORD_WIDTHS))
    distill: bool = True

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if (not self.widths or any(not 0 < width <= 1 for width in self.widths)
                or sorted(self.widths, reverse=True) != list(self.widths) or len(set(self.widths)) != len(self.widths)):
            raise ValueError(f"fjord.widths must be distinct width rates in (0, 1], largest first, got {self.widths}")
        if len(self.widths) > MAX_WIDTHS:
            raise ValueError(f"fjord.widths holds {len(self.widths)} widths, more than a plan carries ({MAX_WIDTHS})")


@dataclass
class ScreeningConfig:
    """The ``screening`` section (see :mod:`coordinator.screening`): ``enabled`` (default true); ``max_ratio``
    (default 10), how many times the median change per step of the round's other updates of the same trained spec
    an update's may be; ``min_peers`` (default 2), how many such updates that comparison needs."""

    enabled: bool = True
    max_ratio: float = 10.0
    min_peers: int = 2

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not self.max_ratio > 1:
            raise ValueError(f"screening.max_ratio must be above 1, got {self.max_ratio}")
        if self.min_peers < 1:
            raise ValueError(f"screening.min_peers must be at least 1, got {self.min_peers}")


@dataclass
class BufferedConfig:
    """The ``buffered`` section, read with ``round_mode: buffered`` (see :mod:`coordinator.staleness`): a round
    aggregates once ``size`` trained updates are in (0, the default: half of those its tasks may bring, rounded up:
    those it sent and those still training from earlier rounds, less the ones answered without an update); a task
    more than ``max_staleness`` rounds old (default 16) is carried no further, and its device gets a new task. With
    ``drain_last`` (default true) the run's last round waits for every task it holds, as a synchronous round does,
    so that nothing trained is left carried when the run ends."""

    size: int = 0
    max_staleness: int = 16
    drain_last: bool = True

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if self.size < 0:
            raise ValueError(f"buffered.size must be a count of answers (0: half of a round's tasks), got {self.size}")
        if self.max_staleness < 1:
            raise ValueError(f"buffered.max_staleness must be at least 1 round, got {self.max_staleness}")


@dataclass
class UploadsConfig:
    """The ``uploads`` section (see :mod:`coordinator.upload_grants`): with ``grant`` (default true) the agents
    that read protocol revision 6 ask before they send an update, and the coordinator lets at most ``window_mib``
    (default 256) MiB of updates be in transfer at once, whatever the fleet's size; a grant whose agent sent
    nothing for ``idle_s`` seconds (default 30) is taken back."""

    grant: bool = True
    window_mib: float = 256.0
    idle_s: float = 30.0

    @property
    def window_bytes(self) -> int:
        return int(self.window_mib * 2**20)

    def validate(self) -> None:
        """Raises ValueError with one clear sentence."""
        if not self.window_mib > 0 or not self.idle_s > 0:
            raise ValueError(f"uploads.window_mib and uploads.idle_s must be positive, got {self.window_mib} and "
                             f"{self.idle_s}")


@dataclass
class CoordinatorConfig:
    """Everything the coordinator daemon needs."""

    federation: str = "default"
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    algorithm: str = "heterofl"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    rounds: int = 10
    fraction: float = 1.0
    min_agents: int = 1
    wait_for_agents_s: float = 120.0
    round_timeout_s: float = 600.0
    #: ``sync``: a round waits for every task (or its deadline); ``buffered``: it aggregates once ``buffered.size``
    #: trained updates are in, and the others count in a later round, weighted by their staleness (FedBuff).
    round_mode: Literal["sync", "buffered"] = "sync"
    buffered: BufferedConfig = field(default_factory=BufferedConfig)
    levels: list[float] = field(default_factory=lambda: list(HETEROFL_RATES))
    level_assignment: Literal["fix", "dynamic"] = "fix"
    level_proportions: list[float] | None = None
    scalefl: ScaleFLConfig = field(default_factory=ScaleFLConfig)
    fedepth: FeDepthConfig = field(default_factory=FeDepthConfig)
    fedavg: FedAvgConfig = field(default_factory=FedAvgConfig)
    fedrolex: FedRolexConfig = field(default_factory=FedRolexConfig)
    depthfl: DepthFLConfig = field(default_factory=DepthFLConfig)
    fjord: FjORDConfig = field(default_factory=FjORDConfig)
    flexfl: FlexFLConfig = field(default_factory=FlexFLConfig)
    adaptivefl: AdaptiveFLConfig = field(default_factory=AdaptiveFLConfig)
    screening: ScreeningConfig = field(default_factory=ScreeningConfig)
    uploads: UploadsConfig = field(default_factory=UploadsConfig)
    weighting: Literal["uniform", "samples"] = "uniform"
    #: What the agents train on ("cpu" or "cuda"): the terms of the memory they report, in which level planning
    #: estimates what each sub-model needs.
    training_device: Literal["cpu", "cuda"] = "cpu"
    state_dir: str = "runs/coordinator"
    resume: bool = False
    seed: int = 0
    #: Serve Prometheus metrics on this port (0: a free one; None: not at all) and address (``coordinator.exporter``).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: Seconds a stopping coordinator keeps serving its metrics, at most, for a scrape of its final state (none
    #: when nothing ever scraped them). 20: Prometheus's example configuration scrapes every 15 s, and a scrape
    #: needs a moment; well inside systemd's 90 s to stop a service. Raise it for a longer scrape interval.
    metrics_linger_s: float = 20.0

    def validate(self) -> None:
        """Cross-field checks; raises ValueError with one clear sentence. (``algorithm`` is checked against the
        strategies' registry when the coordinator makes its strategy.)"""
        validate_name(self.federation, "federation")
        if self.model.family not in FAMILY_NAMES:
            raise ValueError(f"model.family must be one of {', '.join(FAMILY_NAMES)}, got {self.model.family!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.rounds < 1 or self.min_agents < 1:
            raise ValueError("rounds and min_agents must be at least 1")
        if not self.levels or any(not 0 < rate <= 1 for rate in self.levels):
            raise ValueError(f"levels must be width rates in (0, 1], got {self.levels}")
        if sorted(self.levels, reverse=True) != list(self.levels) or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"levels must be distinct and listed from largest to smallest, got {self.levels}")
        if self.level_proportions is not None and (
            any(p < 0 for p in self.level_proportions) or sum(self.level_proportions) <= 0
        ):
            raise ValueError("level_proportions needs one non-negative weight per level, not all zero")
        sized = {"scalefl": self.scalefl.ratios == "auto" and self.scalefl.cost == "memory",
                 "flexfl": self.flexfl.ratios == "auto" and self.flexfl.size == "memory"}
        if self.level_proportions is not None and sized.get(self.algorithm):
            raise ValueError(f"level_proportions needs fixed {self.algorithm}.ratios: with auto the number of levels "
                             "comes from the fleet at its first round")
        if self.data.bn_samples < 1:
            raise ValueError("data.bn_samples must be at least 1")
        if self.round_timeout_s <= 0:
            raise ValueError("round_timeout_s must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port (0-65535), got {self.metrics_port}")
        if not (math.isfinite(self.metrics_linger_s) and self.metrics_linger_s >= 0):
            raise ValueError(f"metrics_linger_s must be 0 or more seconds, got {self.metrics_linger_s}")
        self.broker.validate()
        self.recipe.validate()
        self.scalefl.validate()
        self.fedepth.validate()
        self.screening.validate()
        self.uploads.validate()
        self.buffered.validate()
        self.fedavg.validate()
        self.fedrolex.validate()
        self.depthfl.validate()
        self.fjord.validate()
        self.flexfl.validate()
        self.adaptivefl.validate()
