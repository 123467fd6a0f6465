"""models.inference_memory: the tensors a deployed model holds answering a batch, weights included."""

from __future__ import annotations

import pytest

from models import SubmodelSpec, get_family
from models.inference_memory import estimate_inference_memory

FAMILY = get_family("preresnet20", 10, 1)


def weight_bytes(spec: SubmodelSpec) -> int:
    return sum(tensor.nbytes for tensor in FAMILY.build(spec).state_dict().values() if tensor.is_floating_point())


def test_the_estimate_holds_the_weights_and_grows_with_the_batch_and_the_width() -> None:
    for width in (1.0, 0.25):
        spec = SubmodelSpec(width=width)
        one = estimate_inference_memory(FAMILY, spec, (28, 28))
        # Above the weights by at least the input and the stem's output of one image (float32).
        stem = FAMILY.kept_channels(spec)
        assert one >= weight_bytes(spec) + 4 * 28 * 28 * (1 + min(stem.values()))
        assert estimate_inference_memory(FAMILY, spec, (28, 28), batch_size=8) > one
    assert (estimate_inference_memory(FAMILY, SubmodelSpec(width=1.0), (28, 28))
            > estimate_inference_memory(FAMILY, SubmodelSpec(width=0.5), (28, 28)))
    # Every output runs: exits add their heads.
    assert (estimate_inference_memory(FAMILY, SubmodelSpec(exits=(0, 4)), (28, 28))
            > estimate_inference_memory(FAMILY, SubmodelSpec(), (28, 28)))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        estimate_inference_memory(FAMILY, SubmodelSpec(), (28, 28), batch_size=0)
