import pytest
import torch

from coordinator.aggregation import MaskedAggregator, grid, restrict_rows


def prefix_map(shape):
    return tuple(torch.arange(n) for n in shape)


def test_hand_computed_masked_mean():
    # Global 3x3 of tens; client A (full 3x3) all ones, client B (2x2 prefix) all fives, client C (1x1) nines.
    global_state = {"w": torch.full((3, 3), 10.0), "b": torch.zeros(3)}
    agg = MaskedAggregator(global_state)
    agg.add({"w": torch.ones(3, 3)}, {"w": prefix_map((3, 3))})
    agg.add({"w": torch.full((2, 2), 5.0)}, {"w": prefix_map((2, 2))})
    agg.add({"w": torch.full((1, 1), 9.0)}, {"w": prefix_map((1, 1))})
    out = agg.result()
    expected = torch.tensor([[5.0, 3.0, 1.0], [3.0, 3.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(out["w"], expected)
    torch.testing.assert_close(out["b"], torch.zeros(3))  # untouched keeps its value


def test_untouched_elements_keep_old_values_and_weights_apply():
    global_state = {"w": torch.arange(4.0)}
    agg = MaskedAggregator(global_state)
    agg.add({"w": torch.tensor([2.0, 2.0])}, {"w": (torch.tensor([0, 1]),)}, weight=3.0)
    agg.add({"w": torch.tensor([6.0])}, {"w": (torch.tensor([0]),)}, weight=1.0)
    out = agg.result()
    torch.testing.assert_close(out["w"], torch.tensor([3.0, 2.0, 2.0, 3.0]))
    assert agg.covered("w").tolist() == [True, True, False, False]


def test_rejects_bad_shapes_keys_and_weights():
    agg = MaskedAggregator({"w": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="shape"):
        agg.add({"w": torch.zeros(2, 1)}, {"w": prefix_map((2, 2))})
    with pytest.raises(ValueError, match="lacks"):
        agg.add({"x": torch.zeros(2)}, {"x": prefix_map((2,))})
    with pytest.raises(ValueError, match="positive"):
        agg.add({"w": torch.zeros(2, 2)}, {"w": prefix_map((2, 2))}, weight=0.0)


def test_grid_selects_cartesian_product():
    t = torch.arange(12.0).reshape(3, 4)
    sel = t[grid((torch.tensor([0, 2]), torch.tensor([1, 3])))]
    torch.testing.assert_close(sel, torch.tensor([[1.0, 3.0], [9.0, 11.0]]))


def test_restrict_rows_drops_absent_classes():
    state = {"head.weight": torch.arange(8.0).reshape(4, 2), "body": torch.ones(2)}
    imap = {"head.weight": prefix_map((4, 2)), "body": prefix_map((2,))}
    new_state, new_map = restrict_rows(state, imap, ["head.weight"], [1, 3])
    torch.testing.assert_close(new_state["head.weight"], torch.tensor([[2.0, 3.0], [6.0, 7.0]]))
    assert new_map["head.weight"][0].tolist() == [1, 3]
    agg = MaskedAggregator({"head.weight": torch.zeros(4, 2), "body": torch.zeros(2)})
    agg.add(new_state, new_map)
    out = agg.result()["head.weight"]
    assert out[0].tolist() == [0.0, 0.0] and out[1].tolist() == [2.0, 3.0]


def test_leading_blocks_are_told_from_other_slices():
    from coordinator.aggregation import leading_sizes

    assert leading_sizes((torch.arange(3), torch.arange(5))) == (3, 5)
    assert leading_sizes((torch.arange(3), torch.tensor([], dtype=torch.long))) == (3, 0)
    assert leading_sizes((torch.arange(3), torch.tensor([0, 2]))) is None
    assert leading_sizes((torch.tensor([1, 2]),)) is None


def test_a_leading_block_and_the_same_block_by_index_grid_aggregate_alike():
    from coordinator.aggregation import grid

    generator = torch.Generator().manual_seed(1)
    old = torch.randn(6, 4, generator=generator)
    updates = [torch.randn(4, 3, generator=generator) for _ in range(3)]
    block = (torch.arange(4), torch.arange(3))
    by_view = MaskedAggregator({"w": old})
    for weight, update in zip((1.0, 2.0, 5.0), updates):
        by_view.add({"w": update}, {"w": block}, weight)
    # The same positions named in reverse order: not a leading block, so through the index grid.
    reverse = (torch.arange(3, -1, -1), torch.arange(2, -1, -1))
    by_grid = MaskedAggregator({"w": old})
    for weight, update in zip((1.0, 2.0, 5.0), updates):
        by_grid.add({"w": update.flip(0, 1)}, {"w": reverse}, weight)
    torch.testing.assert_close(by_view.result()["w"], by_grid.result()["w"])
    assert torch.equal(by_view.covered("w"), by_grid.covered("w"))
    assert old[grid(block)].shape == (4, 3)


def test_float32_accumulation_stays_within_its_bound_of_float64():
    generator = torch.Generator().manual_seed(2)
    old = torch.zeros(300, 200)
    updates = [torch.randn(300, 200, generator=generator) for _ in range(100)]
    weights = torch.randint(1, 6000, (100,), generator=generator).tolist()  # sample counts
    full = (torch.arange(300), torch.arange(200))
    aggregator = MaskedAggregator({"w": old})
    for weight, update in zip(weights, updates):
        aggregator.add({"w": update}, {"w": full}, float(weight))
    exact = sum(w * u.double() for w, u in zip(weights, updates)) / sum(weights)
    error = (aggregator.result()["w"].double() - exact).abs().max().item()
    largest = max(update.abs().max().item() for update in updates)
    assert error <= 2 * 100 * 2.0**-24 * largest  # 2 n eps of the terms' magnitude: the sum's and the weights' rounding

