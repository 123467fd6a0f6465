"""common.secagg: the coordinator's unmasked sum of masked slices is each coordinate's plain sum (to fixed-point
resolution) for heterogeneous slices, with and without devices dropping out; a single masked slice says nothing of
the values under it; the pieces (encoding, secret sharing, key agreement, sealing) do what they claim."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.secagg.encoding import MAX_ABS, RESOLUTION, decode, encode
from common.secagg.keys import KeyPair, agree, open_sealed, seal
from common.secagg.masking import PairMask, SecureSum, intersect, mask_slice
from common.secagg.shamir import combine, split

SHAPES = {"conv.weight": (8, 4, 3, 3), "fc.bias": (10,)}


def leading(width: int) -> dict[str, list[np.ndarray]]:
    """The coverage of a width slice: the leading channels (HeteroFL's), the classifier whole."""
    return {"conv.weight": [np.arange(width), np.arange(width // 2), np.arange(3), np.arange(3)],
            "fc.bias": [np.arange(10)]}


def rolled(width: int, start: int) -> dict[str, list[np.ndarray]]:
    """A rolled window of channels (FedRolex's), not a leading block."""
    return {"conv.weight": [(start + np.arange(width)) % 8, np.arange(width // 2), np.arange(3), np.arange(3)],
            "fc.bias": [np.arange(10)]}


def fleet() -> dict[str, dict[str, list[np.ndarray]]]:
    return {"d0": leading(8), "d1": leading(4), "d2": rolled(4, 6), "d3": leading(2), "d4": rolled(6, 3)}


def values_of(coverage: dict[str, list[np.ndarray]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {name: rng.normal(size=tuple(len(index) for index in indices)) for name, indices in coverage.items()}


def plain_sums(devices: dict, values: dict) -> dict[str, np.ndarray]:
    sums = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for device, coverage in devices.items():
        for name, indices in coverage.items():
            sums[name][np.ix_(*indices)] += values[device][name]
    return sums


def run_round(dropped: set[str], rng: np.random.Generator) -> tuple[dict, dict, SecureSum]:
    """Every pair of the fleet agrees a mask, every device a self mask; ``dropped`` send nothing after that."""
    devices = fleet()
    keys = {device: KeyPair() for device in devices}
    self_seeds = {device: rng.bytes(32) for device in devices}
    values = {device: values_of(coverage, rng) for device, coverage in devices.items()}
    total = SecureSum(SHAPES)
    for device, coverage in devices.items():
        if device in dropped:
            continue
        pairs = [PairMask(agree(keys[device], keys[peer].public, b"round-1", b"mask"), 1 if device < peer else -1,
                          devices[peer]) for peer in devices if peer != device]
        total.add(mask_slice(values[device], coverage, SHAPES, self_seeds[device], pairs), coverage)
    for device in devices:  # the coordinator, with what the survivors give back
        if device not in dropped:
            total.remove_self_mask(self_seeds[device], devices[device])
            continue
        for survivor in (other for other in devices if other not in dropped):
            seed = agree(keys[device], keys[survivor].public, b"round-1", b"mask")  # from the dropped device's key
            total.remove_pair_mask(seed, 1 if survivor < device else -1, devices[survivor], devices[device])
    survivors = {device: coverage for device, coverage in devices.items() if device not in dropped}
    return survivors, values, total


@pytest.mark.parametrize("dropped", [set(), {"d3"}, {"d0", "d4"}])
def test_the_unmasked_sum_is_the_plain_masked_sum_with_and_without_dropouts(dropped: set[str]) -> None:
    survivors, values, total = run_round(dropped, np.random.default_rng(len(dropped)))
    expected = plain_sums(survivors, values)
    for name, (sums, counts) in total.result().items():
        np.testing.assert_allclose(sums, expected[name], atol=len(survivors) * RESOLUTION)
        held = np.zeros(SHAPES[name], dtype=np.int64)
        for coverage in survivors.values():
            held[np.ix_(*coverage[name])] += 1
        assert np.array_equal(counts, held)


def test_a_masked_slice_is_uncorrelated_with_the_values_under_it() -> None:
    rng = np.random.default_rng(0)
    coverage = {"w": [np.arange(200_000)]}
    values = {"w": rng.normal(size=200_000)}
    peer = PairMask(rng.bytes(32), 1, {"w": [np.arange(100_000)]})
    masked = mask_slice(values, coverage, {"w": (200_000,)}, rng.bytes(32), [peer])["w"]
    as_numbers = masked.astype(np.float64)  # uniform over [0, 2^64) whatever lies under it
    correlation = np.corrcoef(as_numbers, values["w"])[0, 1]
    assert abs(correlation) < 5 / np.sqrt(200_000)
    assert abs(np.corrcoef(decode(masked), values["w"])[0, 1]) < 5 / np.sqrt(200_000)
    unmasked = mask_slice(values, coverage, {"w": (200_000,)}, bytes(32), [])["w"]
    assert np.corrcoef(decode(unmasked - mask_slice({"w": np.zeros(200_000)}, coverage, {"w": (200_000,)},
                                                    bytes(32), [])["w"]), values["w"])[0, 1] > 0.999


def test_slices_that_share_no_coordinate_exchange_no_mask() -> None:
    assert intersect([np.arange(4)], [np.arange(4, 8)]) is None
    common = intersect([np.array([6, 7, 0, 1])], [np.arange(2)])
    assert common is not None and list(common[0]) == [0, 1]


def test_fixed_point_keeps_its_resolution_and_refuses_what_it_cannot_hold() -> None:
    values = np.array([-3.25, 0.0, 1e-7, 12345.678])
    assert np.all(np.abs(decode(encode(values)) - values) <= RESOLUTION / 2)
    assert np.allclose(decode(encode(values) + encode(-values)), 0.0)
    with pytest.raises(ValueError, match="beyond the fixed point's range"):
        encode(np.array([MAX_ABS]))
    with pytest.raises(ValueError, match="not finite"):
        encode(np.array([np.nan]))


def test_any_threshold_of_shares_gives_the_secret_back_and_fewer_do_not() -> None:
    secret = bytes(range(32))
    shares = split(secret, 3, [1, 2, 3, 4, 5])
    for chosen in itertools.combinations(shares, 3):
        assert combine({point: shares[point] for point in chosen}, 3) == secret
    with pytest.raises(ValueError, match="2 share\\(s\\) cannot give back a secret shared with threshold 3"):
        combine({1: shares[1], 2: shares[2]}, 3)
    assert combine({1: shares[1], 2: shares[2], 3: shares[3] + 1}, 3) != secret  # a wrong share: another value
    with pytest.raises(ValueError, match="threshold of 6 needs at least that many holders"):
        split(secret, 6, [1, 2, 3])


def test_both_sides_agree_the_same_seed_and_a_sealed_share_opens_only_as_sealed() -> None:
    first, second = KeyPair(), KeyPair()
    mask = agree(first, second.public, b"r1", b"mask")
    assert mask == agree(second, first.public, b"r1", b"mask") != agree(first, second.public, b"r2", b"mask")
    assert mask != agree(first, second.public, b"r1", b"seal")  # one key per purpose
    assert agree(KeyPair.from_secret(first.secret_bytes()), second.public, b"r1", b"mask") == mask
    with pytest.raises(ValueError, match="a derived key is for one of"):
        agree(first, second.public, b"r1", b"other")
    key = agree(first, second.public, b"shares", b"seal")
    sealed = seal(key, b"share", b"d0->d1")
    assert open_sealed(key, sealed, b"d0->d1") == b"share"
    for bad_key, associated, altered in ((key, b"d0->d2", sealed), (bytes(32), b"d0->d1", sealed),
                                         (key, b"d0->d1", sealed[:-1] + bytes([sealed[-1] ^ 1]))):
        with pytest.raises(ValueError, match="does not open"):
            open_sealed(bad_key, altered, associated)


def test_a_slice_that_is_not_its_coverage_is_refused() -> None:
    coverage = leading(4)
    values = values_of(coverage, np.random.default_rng(0))
    with pytest.raises(ValueError, match="are not its coverage's"):
        mask_slice({"fc.bias": values["fc.bias"]}, coverage, SHAPES, bytes(32), [])
    twice = {**coverage, "fc.bias": [np.array([0, 0, 1, 2, 3, 4, 5, 6, 7, 8])]}
    with pytest.raises(ValueError, match="distinct and within 0..9"):
        mask_slice(values, twice, SHAPES, bytes(32), [])
    total = SecureSum(SHAPES)
    masked = mask_slice(values, coverage, SHAPES, bytes(32), [])
    with pytest.raises(ValueError, match="holds tensors"):
        total.add({"fc.bias": masked["fc.bias"]}, coverage)
    with pytest.raises(ValueError, match="has shape"):
        total.add({**masked, "fc.bias": masked["fc.bias"][:3]}, coverage)
    assert not total.counts["fc.bias"].any()  # nothing folded
