"""common.secagg.client and server: whole secure rounds in one process, devices dropping out at each step; the
unmasked sum is the plain sum over the devices that sent a slice; the rules a device keeps when it gives shares
back, and what the coordinator refuses."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from common.secagg.client import MASK, SELF, Reveal, SecureClient
from common.secagg.encoding import RESOLUTION, encode
from common.secagg.graph import neighbour_count, neighbours, threshold_of
from common.secagg.masking import MIN_HOLDERS, _mask
from common.secagg.server import SecureServer

SHAPES = {"w": (16, 6), "b": (16,)}
CONTEXT = b"fed:round-3"


def coverage(index: int) -> dict[str, list[np.ndarray]]:
    """Slices of three widths, every fourth device a rolled window."""
    width = (16, 8, 4)[index % 3]
    rows = (np.arange(width) + 5) % 16 if index % 4 == 3 else np.arange(width)
    return {"w": [rows, np.arange(6)], "b": [rows]}


def secure_round(devices: int, before_sharing: set[str], before_sending: set[str], seed: int = 0):
    rng = np.random.default_rng(seed)
    names = [f"d{index:03d}" for index in range(devices)]
    coverages = {name: coverage(index) for index, name in enumerate(names)}
    values = {name: {key: rng.normal(size=tuple(len(i) for i in idx)) for key, idx in coverages[name].items()}
              for name in names}
    clients = {name: SecureClient(name, CONTEXT) for name in names}
    server = SecureServer(CONTEXT, SHAPES, coverages, random.Random(seed))
    rosters = server.rosters({name: client.advert() for name, client in clients.items()})
    bundles = {name: clients[name].share(rosters[name]) for name in names if name not in before_sharing}
    for recipient, sealed in server.relay(bundles).items():
        clients[recipient].receive(sealed)
    senders = [name for name in bundles if name not in before_sending]
    kept = server.keep()
    for name in senders:
        server.add(name, clients[name].mask(values[name], coverages[name], SHAPES, kept[name]))
    survivors, dropped = server.request()
    reveals = {name: clients[name].reveal(survivors, dropped) for name in survivors}
    result = server.unmask(reveals)
    expected = {key: np.zeros(shape) for key, shape in SHAPES.items()}
    for name in (name for name in senders if name not in server.left_out):  # what each sent where it hides among
        # enough others' (SecureServer.safe); a sender left out after the dropouts is out of the sum
        for key, idx in coverages[name].items():
            expected[key][np.ix_(*idx)] += np.where(kept[name][key], values[name][key], 0.0)
    return result, expected, len(senders), clients, server


@pytest.mark.parametrize(("devices", "early", "late"), [(8, set(), set()), (8, {"d001"}, {"d004"}),
                                                       (40, {"d003", "d017"}, {"d000", "d021", "d033", "d039"})])
def test_the_unmasked_sum_is_the_plain_sum_over_the_devices_that_sent(devices: int, early: set[str],
                                                                      late: set[str]) -> None:
    result, expected, senders, _, server = secure_round(devices, early, late)
    if devices == 40:  # SecAgg+: fewer neighbours than devices
        assert all(len(others) == neighbour_count(40) < 39 for others in server.graph.values())
    for key, (sums, counts) in result.items():
        np.testing.assert_allclose(sums, expected[key], atol=senders * RESOLUTION)
        assert counts.max() <= senders and counts.sum() > 0


def test_a_device_gives_back_one_kind_of_share_per_device_once_and_only_among_enough_survivors() -> None:
    clients = {name: SecureClient(name, CONTEXT) for name in ("a", "b", "c", "d")}
    server = SecureServer(CONTEXT, SHAPES, {name: coverage(0) for name in clients}, random.Random(0))
    rosters = server.rosters({name: client.advert() for name, client in clients.items()})
    for recipient, sealed in server.relay({name: clients[name].share(rosters[name]) for name in clients}).items():
        clients[recipient].receive(sealed)
    with pytest.raises(ValueError, match="named both as survivors and as dropped: b"):
        clients["a"].reveal(["a", "b", "c"], ["b"])
    with pytest.raises(ValueError, match="'a' is not among the survivors"):
        clients["a"].reveal(["b", "c", "d"], [])
    with pytest.raises(ValueError, match="0 of its neighbours survived, fewer than the threshold 2"):
        clients["a"].reveal(["a"], ["b", "c", "d"])
    with pytest.raises(ValueError, match="0 of its neighbours survived"):  # names it does not know do not count
        clients["a"].reveal(["a", "x", "y", "z"], ["b", "c", "d"])
    given = clients["a"].reveal(["a", "b", "c"], ["d"])
    assert {(reveal.owner, reveal.kind) for reveal in given} == {("b", SELF), ("c", SELF), ("d", MASK)}
    with pytest.raises(ValueError, match="given back already"):
        clients["a"].reveal(["a", "b", "c", "d"], [])


def test_the_coordinator_refuses_what_would_leak_or_cannot_be_unmasked() -> None:
    coverages = {name: coverage(0) for name in ("a", "b", "c", "d")}
    server = SecureServer(CONTEXT, SHAPES, coverages, random.Random(0))
    clients = {name: SecureClient(name, CONTEXT) for name in coverages}
    with pytest.raises(ValueError, match="2 device\\(s\\) advertised keys: secure aggregation needs at least 3"):
        server.rosters({name: clients[name].advert() for name in ("a", "b")})
    rosters = server.rosters({name: client.advert() for name, client in clients.items()})
    bundles = {name: clients[name].share(rosters[name]) for name in ("a", "b", "c")}
    with pytest.raises(ValueError, match="'a' sealed shares for x, not its neighbours"):
        server.relay({**bundles, "a": {**bundles["a"], "x": b""}})
    with pytest.raises(ValueError, match="'a' sealed shares for 2 of its 3 neighbours"):
        server.relay({**bundles, "a": {peer: box for peer, box in bundles["a"].items() if peer != "b"}})
    with pytest.raises(ValueError, match="a majority of them needed"):
        clients["d"].share(replace(rosters["d"], threshold=1))
    for recipient, sealed in server.relay(bundles).items():
        clients[recipient].receive(sealed)
    values = {key: np.zeros(tuple(len(i) for i in idx)) for key, idx in coverage(0).items()}
    with pytest.raises(ValueError, match="'d', who did not share its keys"):
        server.add("d", clients["a"].mask(values, coverage(0), SHAPES))
    server.add("a", clients["a"].mask(values, coverage(0), SHAPES))
    with pytest.raises(ValueError, match="the round cannot be unmasked: "):
        server.request()
    server.add("b", clients["b"].mask(values, coverage(0), SHAPES))
    server.add("c", clients["c"].mask(values, coverage(0), SHAPES))
    survivors, dropped = server.request()
    reveals = {name: clients[name].reveal(survivors, dropped) for name in survivors}
    # A forged share of a dropped device's mask key gives back another key, which its advert tells (a forged share
    # of a self-mask seed goes unseen: SecAgg's devices are honest but curious).
    forged = {**reveals, "a": [Reveal(r.owner, r.kind, r.point, r.value + 1) for r in reveals["a"]]}
    with pytest.raises(ValueError, match="the shares of 'd''s mask key give back another key|do not belong together"):
        server.unmask(forged)
    with pytest.raises(ValueError, match="gave back a share the round did not ask for"):
        server.unmask({**reveals, "a": [Reveal("d", SELF, reveals["a"][0].point, 1)]})
    server.unmask(reveals)
    with pytest.raises(ValueError, match="unmasked already"):
        server.unmask(reveals)


def test_the_graph_is_symmetric_and_regular_and_the_threshold_a_majority() -> None:
    names = [f"d{index}" for index in range(100)]
    k = neighbour_count(100)
    graph = neighbours(names, k, random.Random(1))
    assert k % 2 == 0 and all(len(others) == k for others in graph.values())
    assert all(name in graph[other] for name, others in graph.items() for other in others)
    assert threshold_of(k) == k // 2 + 1 and neighbour_count(10) == 9


def test_no_unmasked_sum_holds_fewer_than_three_devices_values() -> None:
    # Six devices: rows 8-15 are held by two (d000 and the rolled d003): they send 0 there, so the sum the
    # coordinator unmasks says nothing of either, and those rows are not aggregated (count 0).
    result, expected, _, _, server = secure_round(6, set(), set())
    sums, counts = result["w"]
    assert not sums[8:].any() and not counts[8:].any() and counts[:8].min() >= MIN_HOLDERS
    assert not server.total.result()["w"][0][8:].any()  # what the coordinator held: zeros, not two devices' values
    np.testing.assert_allclose(sums, expected["w"], atol=6 * RESOLUTION)
    # Seven: rows 8-15 held by three; one of them dropping out after sharing leaves two, whose sum would give their
    # values away: both are left out as if they had dropped, then the devices whose values that leaves too thinly
    # hidden, and so on: here every one, so the round is not unmasked.
    with pytest.raises(ValueError, match="the round cannot be unmasked: 0 of the neighbours of .* remain among the "
                                         "senders, the threshold is 4 \\(6 sender\\(s\\) left out"):
        secure_round(7, set(), {"d006"})


def test_senders_left_too_thinly_hidden_by_a_dropout_are_left_out_and_the_round_goes_on() -> None:
    # Nine devices, three at each of widths 1, 1/2, 1/4 (nested, no rolled window): a full-width one dropping out
    # after sharing leaves rows 8-15 to two, who are left out (their mask keys asked for, never their self-mask
    # seeds: their values stay hidden); every other value is still hidden among three or more.
    names = [f"d{index:03d}" for index in range(9)]
    coverages = {name: {"w": [np.arange((16, 8, 4)[index % 3]), np.arange(6)], "b": [np.arange((16, 8, 4)[index % 3])]}
                 for index, name in enumerate(names)}
    rng = np.random.default_rng(5)
    values = {name: {key: rng.normal(size=tuple(len(i) for i in idx)) for key, idx in coverages[name].items()}
              for name in names}
    clients = {name: SecureClient(name, CONTEXT) for name in names}
    server = SecureServer(CONTEXT, SHAPES, coverages, random.Random(5))
    rosters = server.rosters({name: client.advert() for name, client in clients.items()})
    for recipient, sealed in server.relay({name: clients[name].share(rosters[name]) for name in names}).items():
        clients[recipient].receive(sealed)
    kept = server.keep()
    for name in names[:-3] + names[-2:]:  # d006 (full width) is gone after sharing
        server.add(name, clients[name].mask(values[name], coverages[name], SHAPES, kept[name]))
    survivors, dropped = server.request()
    assert server.left_out == {"d000", "d003"} and dropped == ["d000", "d003", "d006"]
    result = server.unmask({name: clients[name].reveal(survivors, dropped) for name in survivors})
    sums, counts = result["w"]
    expected = sum(np.pad(values[name]["w"], ((0, 16 - len(coverages[name]["w"][0])), (0, 0))) for name in survivors)
    np.testing.assert_allclose(sums, expected, atol=9 * RESOLUTION)
    assert not counts[8:].any() and (counts[4:8] == 3).all() and (counts[:4] == 6).all()


@pytest.mark.parametrize("seed", [0, 3, 10])  # the three full-width devices: joined; a pair and one alone; none joined
def test_on_a_sparse_graph_no_value_is_sent_where_no_neighbour_holds_it_too(seed: int) -> None:
    # 30 devices, 3 of them at full width: from 18 devices on a device has some neighbours only, and a full-width one
    # may have no full-width neighbour. Where its rows are masked by no pair mask, taking its self mask away would
    # give its values: it must send 0 there (and the sum there is over the others' groups only).
    names = [f"d{index:03d}" for index in range(30)]
    wide = {"d000", "d010", "d020"}
    coverages = {name: {"w": [np.arange(16 if name in wide else 4), np.arange(6)],
                        "b": [np.arange(16 if name in wide else 4)]} for name in names}
    rng = np.random.default_rng(seed)
    values = {name: {key: rng.normal(size=tuple(len(i) for i in idx)) + 3.0 for key, idx in coverages[name].items()}
              for name in names}
    clients = {name: SecureClient(name, CONTEXT) for name in names}
    server = SecureServer(CONTEXT, SHAPES, coverages, random.Random(seed))
    rosters = server.rosters({name: client.advert() for name, client in clients.items()})
    assert len(rosters["d000"].neighbours) < len(names) - 1  # a sparse graph
    for recipient, sealed in server.relay({name: clients[name].share(rosters[name]) for name in names}).items():
        clients[recipient].receive(sealed)
    kept = server.keep()
    for name in names:
        masked = clients[name].mask(values[name], coverages[name], SHAPES, kept[name])
        for key, indices in coverages[name].items():
            bare = masked[key] - _mask(clients[name]._self_seed, key, SHAPES[key], indices)
            sent = encode(np.where(kept[name][key], values[name][key], 0.0))
            # Where it kept a value, some pair mask hides it; where it did not, it sent 0 (masks or none).
            assert not np.any((bare == sent) & kept[name][key]), (name, key)
            if name in wide:  # rows 4-15: kept only where the three full-width devices are joined as one group
                joined = sum(1 for a in wide for b in wide if a < b and b in server.graph[a]) >= 2
                assert kept[name][key][4:].all() if joined else not kept[name][key][4:].any(), (name, key, joined)
        server.add(name, masked)
    survivors, dropped = server.request()
    result = server.unmask({name: clients[name].reveal(survivors, dropped) for name in survivors})
    expected = np.zeros(SHAPES["w"])
    for name in names:
        expected[np.ix_(*coverages[name]["w"])] += np.where(kept[name]["w"], values[name]["w"], 0.0)
    np.testing.assert_allclose(result["w"][0], expected, atol=30 * RESOLUTION)
