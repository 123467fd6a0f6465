"""A secure round's slices on the wire: runs of indices and packed holder bits read back as written."""

from __future__ import annotations

import numpy as np
import pytest

from common.secagg.wire import (
    coverage_from_runs,
    coverage_to_runs,
    from_runs,
    keep_from_bits,
    keep_to_bits,
    to_runs,
)


@pytest.mark.parametrize(("indices", "runs"), [
    ([0, 1, 2, 3], [0, 4]),                    # a width slice: one run
    ([6, 7, 0, 1], [6, 8, 0, 2]),              # a rolled window: two, in its order
    ([1, 3, 4, 9], [1, 2, 3, 5, 9, 10]),       # a classifier's seen rows
    ([5], [5, 6]),
])
def test_indices_travel_as_runs_in_their_order(indices: list[int], runs: list[int]) -> None:
    assert to_runs(np.array(indices)) == runs
    assert from_runs(runs).tolist() == indices


def test_a_coverage_reads_back_as_written() -> None:
    coverage = {"global/w": (np.array([0, 1, 2]), np.array([4, 5, 0, 1])), "global/b": (np.array([3, 7]),)}
    back = coverage_from_runs(coverage_to_runs(coverage))
    assert back.keys() == coverage.keys()
    for name, indices in coverage.items():
        assert [index.tolist() for index in back[name]] == [index.tolist() for index in indices]


@pytest.mark.parametrize(("runs", "message"), [([0], "odd number"), ([3, 3], "empty or negative"),
                                               ([5, 2], "empty or negative"), ([-1, 2], "empty or negative")])
def test_malformed_runs_are_refused(runs: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_runs(runs)


def test_holder_bits_read_back_over_the_slice_and_must_match_it() -> None:
    coverage = {"global/w": (np.arange(3), np.arange(5)), "global/b": (np.arange(9),)}
    rng = np.random.default_rng(0)
    keep = {"global/w": rng.random((3, 5)) > 0.5, "global/b": rng.random(9) > 0.5}
    bits = keep_to_bits(keep)
    assert len(bits["global/w"]) == 2 and len(bits["global/b"]) == 2  # 15 and 9 bits, packed
    back = keep_from_bits(bits, coverage)
    assert all(np.array_equal(back[name], keep[name]) for name in keep)
    with pytest.raises(ValueError, match="bytes of holder bits for 15 coordinates"):
        keep_from_bits({**bits, "global/w": bits["global/w"] + b"\x00"}, coverage)
    with pytest.raises(ValueError, match="name tensors"):
        keep_from_bits({"global/w": bits["global/w"]}, coverage)
