"""models.shapes: the one check that a spec's tensors have the shapes its index map says, with the caller's words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import SubmodelSpec, check_shapes, get_family
from models.shapes import check_shape, index_shape


def test_a_specs_own_tensors_pass_and_the_first_misfit_is_named() -> None:
    family = get_family("cnn", 10, 1, hidden=(4, 8))
    spec = SubmodelSpec.uniform(0.5)
    index_map = family.index_map(spec)
    state = family.build(spec).state_dict()
    assert {key: index_shape(index_map[key]) for key in state} == {key: tuple(t.shape) for key, t in state.items()}
    check_shapes(state, index_map)
    check_shapes({key: value.numpy() for key, value in state.items()}, index_map)  # arrays as well as tensors
    wrong = {**state, "conv1.bias": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"^tensor 'conv1\.bias' has shape \(4,\), its index map says \(2,\)$"):
        check_shapes(wrong, index_map)
    with pytest.raises(ValueError, match=r"^tensor 'conv1\.bias' has shape \(4,\), the spec needs \(2,\)$"):
        check_shapes(wrong, index_map, says="the spec needs")


def test_a_scalar_maps_to_no_index() -> None:
    check_shape("bn.num_batches_tracked", np.zeros(()).shape, ())
    with pytest.raises(ValueError, match=r"has shape \(1,\), expected \(\)"):
        check_shape("bn.num_batches_tracked", (1,), (), says="expected")
