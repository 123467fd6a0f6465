"""models.onnx_export: the exported graphs compute what the model computes, and its stages chain into its outputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from models import SubmodelSpec, get_family
from models.onnx_export import AnswerModule, StageModule, export_answer, export_stages, stages

FAMILY = get_family("cnn", 10, 1, hidden=(4, 8, 8))
SHAPE = (1, 8, 8)


def trained_looking(spec: SubmodelSpec) -> torch.nn.Module:
    """A model of ``spec`` with random weights and BN statistics (not the initial ones), in eval mode."""
    torch.manual_seed(0)
    net = FAMILY.build(spec)
    with torch.no_grad():
        for name, tensor in net.state_dict().items():
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
            elif name.endswith("running_mean"):
                tensor.normal_()
    return net.eval()


def run(graph: bytes, x: torch.Tensor) -> list[np.ndarray]:
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})


def test_stages_cut_the_model_at_each_output() -> None:
    net = trained_looking(SubmodelSpec(exits=(0, 1)))
    cuts = stages(net)
    assert [(s.start, s.stop, s.exit_block, s.last) for s in cuts] == [
        (0, 1, 0, False), (1, 2, 1, False), (2, len(net.blocks), None, True)]
    cut = trained_looking(SubmodelSpec(depth=2, exits=(0, 1)))  # no final head: the last exit ends it
    assert [(s.start, s.stop, s.exit_block, s.last) for s in stages(cut)] == [(0, 1, 0, False), (1, 2, 1, True)]


def test_the_stages_chained_give_every_output() -> None:
    net = trained_looking(SubmodelSpec(width=0.5, exits=(0, 1)))
    x = torch.randn(5, *SHAPE)
    with torch.no_grad():
        expected = net.forward_exits(x)
        features = x
        for number, stage in enumerate(stages(net)):
            out = StageModule(net, stage)(features)
            features, logits = (None, out) if stage.last else out
            torch.testing.assert_close(logits, expected[number])


def test_the_exported_answer_is_the_models_last_output_or_its_ensemble() -> None:
    net = trained_looking(SubmodelSpec(width=0.5, exits=(0, 1)))
    x = torch.randn(7, *SHAPE)  # another batch size than the export's example: the batch dimension is free
    with torch.no_grad():
        outputs = net.forward_exits(x)
        ensemble = AnswerModule(net, (1, 2))(x)
    np.testing.assert_allclose(run(export_answer(net, SHAPE), x)[0], outputs[-1].numpy(), atol=1e-5)
    np.testing.assert_allclose(run(export_answer(net, SHAPE, (1, 2)), x)[0], ensemble.numpy(), atol=1e-5)
    torch.testing.assert_close(ensemble, (outputs[1] + outputs[2]) / 2)
    with pytest.raises(ValueError, match="not outputs"):
        AnswerModule(net, (3,))


def test_the_exported_stages_chain_like_the_model() -> None:
    net = trained_looking(SubmodelSpec(width=0.5, exits=(1,)))
    x = torch.randn(3, *SHAPE)
    with torch.no_grad():
        expected = [out.numpy() for out in net.forward_exits(x)]
    first, second = export_stages(net, SHAPE)
    features, logits = run(first, x)
    np.testing.assert_allclose(logits, expected[0], atol=1e-5)
    np.testing.assert_allclose(run(second, torch.from_numpy(features))[0], expected[1], atol=1e-5)
