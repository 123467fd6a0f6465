"""Masked (index-aware) aggregation of sub-model updates into the global model: `MaskedAggregator` per tensor
group, `RoundAggregate` for a round's updates across the strategy's groups.

Each global element becomes the weighted mean of the updates whose sub-model contains it; an element
no update touched keeps its old value (HeteroFL Eq. 1-3, ScaleFL Eq. 2, FlexFL, AdaptiveFL Alg. 2).

A slice that is a leading block of the global tensor in every dimension (the full model, HeteroFL's and
FlexFL's width slices) is added through a view, in place; any other (AdaptiveFL's kept layers, rows of seen
classes) through its index grid. Sums accumulate in the tensor's own precision, at least float32: the error of a
float32 weighted mean of n updates is at most about 2 n 2^-24 of their largest magnitude (the sum's rounding and
the weights'; 1.2e-5 for 100 updates), far below what one SGD step changes; ``tests/coordinator/test_aggregation.py``
checks it against float64 on 100 updates with sample-count weights. Weights are summed in float64 (one number per
leading block, a tensor only for index grids). The sums depend on the order updates come in, at float32 rounding:
a round is reproducible to that, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from coordinator.tasks import State, TaskResult
from models.shapes import check_shape

IndexMap = Mapping[str, Sequence[torch.Tensor]]


def leading_sizes(indices: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The sizes of the leading block ``indices`` select (each dimension's indices 0, 1, ..., n-1), or None when
    some dimension's are anything else."""
    sizes = []
    for idx in indices:
        count = idx.numel()
        if count and not torch.equal(idx, torch.arange(count, dtype=idx.dtype, device=idx.device)):
            return None
        sizes.append(count)
    return tuple(sizes)


def leading(tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """A view of the leading block of ``tensor`` with ``sizes``."""
    for dim, size in enumerate(sizes):
        tensor = tensor.narrow(dim, 0, size)
    return tensor


def grid(indices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors selecting the cartesian product of per-dimension ``indices``."""
    ndim = len(indices)
    return tuple(idx.reshape([-1 if d == dim else 1 for d in range(ndim)]) for dim, idx in enumerate(indices))


class MaskedAggregator:
    """Accumulates sub-model states by their index maps; ``result()`` gives the new global state.

    ``add(local_state, index_map, weight)`` adds every tensor of ``local_state`` at the positions its index map
    names (one index tensor per dimension into the global tensor). Uniform weights give HeteroFL's unweighted mean;
    sample counts give the sample-weighted mean.

    The weights of a leading-block slice are kept as one number per block size (summed in float64: exact for the
    sample counts of any fleet), and only laid out over the tensor by ``result()``: adding such a slice costs one
    in-place ``add_``. ``global_state`` is read, never copied: it must not change until ``result()``.
    """

    def __init__(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = {key: value.detach() for key, value in global_state.items()}
        self._sums: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, dict[tuple[int, ...], float]] = {}  # key -> leading-block sizes -> summed weight
        self._scattered: dict[str, torch.Tensor] = {}  # key -> float64 weights of index-grid slices
        self.updates = 0

    def add(self, local_state: Mapping[str, torch.Tensor], index_map: IndexMap, weight: float = 1.0) -> None:
        """Add one client's tensors; raises ValueError (adding nothing) if a key or shape does not match."""
        if not weight > 0:
            raise ValueError(f"aggregation weight must be positive, got {weight}")
        self._fold(local_state, index_map, float(weight))
        self.updates += 1

    def _checked(self, local_state: Mapping[str, torch.Tensor], index_map: IndexMap) -> list[str]:
        """The floating-point keys of ``local_state`` to fold; raises ValueError before anything is folded."""
        keys = []
        for key, local in local_state.items():
            if key not in self._global:
                raise ValueError(f"update has tensor {key!r} that the global model lacks")
            if key not in index_map:
                raise ValueError(f"no index map for tensor {key!r}")
            if not self._global[key].is_floating_point():
                continue  # counters such as BN's num_batches_tracked are not averaged
            check_shape(key, local.shape, index_map[key])
            keys.append(key)
        return keys

    def _fold(self, local_state: Mapping[str, torch.Tensor], index_map: IndexMap, weight: float) -> None:
        for key in self._checked(local_state, index_map):
            target = self._global[key]
            if key not in self._sums:
                self._sums[key] = torch.zeros_like(target, dtype=torch.promote_types(target.dtype, torch.float32))
            sums = self._sums[key]
            values = local_state[key].detach().to(sums.dtype)
            indices = index_map[key]
            sizes = leading_sizes(indices)
            if sizes is not None:  # a view, added in place: no index grid, no gathered copy
                leading(sums, sizes).add_(values, alpha=weight)
                blocks = self._blocks.setdefault(key, {})
                blocks[sizes] = blocks.get(sizes, 0.0) + weight
            else:
                where = grid(indices)
                sums[where] += weight * values
                if key not in self._scattered:
                    self._scattered[key] = torch.zeros_like(target, dtype=torch.float64)
                self._scattered[key][where] += weight

    def weights(self, key: str) -> torch.Tensor:
        """The summed weight of every element of ``key`` (float64; zero where no update covers it)."""
        target = self._global[key]
        weights = self._scattered[key].clone() if key in self._scattered else torch.zeros_like(
            target, dtype=torch.float64)
        for sizes, total in self._blocks.get(key, {}).items():
            leading(weights, sizes).add_(total)
        return weights

    def covered(self, key: str) -> torch.Tensor:
        """Boolean mask of the elements of ``key`` that at least one update covers."""
        return self.weights(key) > 0

    def result(self, noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """The aggregated global state: weighted means where covered, old values elsewhere. ``noise_std`` above 0
        (differential privacy, uniform weights): Gaussian noise of that standard deviation added to every covered
        element's sum before it is divided by its weight (its contributor count), drawn from ``generator``."""
        merged: dict[str, torch.Tensor] = {}
        for key, old in self._global.items():
            sums = self._sums.get(key)
            if sums is None:
                merged[key] = old.clone()
                continue
            weights = self.weights(key)
            divisor = weights.clamp_min(1e-12).to(sums.dtype)
            if noise_std > 0:
                sums = sums + noise_std * torch.randn(sums.shape, generator=generator, dtype=sums.dtype)
            mean = sums / divisor
            covered = weights > 0
            merged[key] = torch.where(covered, mean, old.to(mean.dtype)).to(old.dtype)
        return merged


def restrict_rows(
    local_state: Mapping[str, torch.Tensor],
    index_map: IndexMap,
    keys: Iterable[str],
    rows: Sequence[int],
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, ...]]]:
    """Keep only ``rows`` (dimension 0) of the tensors named by ``keys``.

    Used for masked cross-entropy: the classifier rows of classes a client never saw are not
    aggregated from that client.
    """
    state = dict(local_state)
    new_map = {key: tuple(idx) for key, idx in index_map.items()}
    row_index = torch.as_tensor(list(rows), dtype=torch.long)
    for key in keys:
        if key not in state:
            continue
        local_rows = index_map[key][0]
        positions = torch.isin(local_rows, row_index).nonzero().flatten()
        state[key] = state[key][positions]
        new_map[key] = (local_rows[positions], *index_map[key][1:])
    return state, new_map


class RoundAggregate:
    """A round's updates folded in one by one as they are accepted, per group: masked (index-aware) aggregation
    (each element the weighted mean of the updates that hold it, the others unchanged). Where a task's plan masks
    absent classes, that update's classifier rows of those classes are left out. Memory stays one accumulator per
    group, whatever the number of updates. ``states`` must not change until :meth:`result`."""

    def __init__(self, states: Mapping[str, State], weight: Callable[[TaskResult], float],
                 classifier_keys: Sequence[str]) -> None:
        self._states = states
        self._weight = weight
        self._classifier_keys = list(classifier_keys)
        self._aggregators: dict[str, MaskedAggregator] = {}
        #: Why the round's updates could not be aggregated after all, once :meth:`result` ran (None: they were).
        self.failure: str | None = None
        #: Agents whose update was left out of the result after all, with the reason (a secure round's).
        self.left_out: dict[str, str] = {}

    @property
    def states(self) -> Mapping[str, State]:
        """The states the round folds its updates into."""
        return self._states

    @property
    def classifier_keys(self) -> list[str]:
        """The classifier's tensors (rows of classes a masked update never saw are left out)."""
        return self._classifier_keys

    @property
    def updates(self) -> int:
        """How many updates are folded in now."""
        return sum(aggregator.updates for aggregator in self._aggregators.values())

    def _prepared(self, result: TaskResult) -> tuple[State, dict[str, tuple[torch.Tensor, ...]]]:
        state, index_map = result.state, {key: tuple(idx) for key, idx in result.index_map.items()}
        if result.task.plan.uses_masked_ce:
            state, index_map = restrict_rows(state, index_map, self._classifier_keys, result.labels)
        return state, index_map

    def add(self, result: TaskResult) -> None:
        """Fold one validated update in (ValueError, folding nothing, when it does not fit its group's model)."""
        group = result.task.group
        if group not in self._aggregators:
            self._aggregators[group] = MaskedAggregator(self._states[group])
        self._aggregators[group].add(*self._prepared(result), self._weight(result))

    def fresh(self) -> RoundAggregate:
        """An empty aggregate over the same states, weighting and classifier."""
        return RoundAggregate(self._states, self._weight, self._classifier_keys)

    def result(self, noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict[str, State]:
        """The new states: each group's aggregate (with ``noise_std``: see :meth:`MaskedAggregator.result`), the
        groups no update reached unchanged."""
        merged = dict(self._states)
        for group, aggregator in self._aggregators.items():
            if aggregator.updates:
                merged[group] = aggregator.result(noise_std, generator)
        return merged
