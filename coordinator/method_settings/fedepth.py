"""FeDepth's settings: the ``fedepth`` section of a coordinator configuration
(:mod:`coordinator.strategies.fedepth` uses them)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.plan import MAX_COPIES, ROUTES


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
