"""Running an exported model (:mod:`common.model_package`): with onnxruntime where it is installed, else with torch
from the model's safetensors weights; its whole answer, or early-exit inference that stops, image by image, at the
first output confident enough.

Early exit runs the model's stages one after another: after each output the images whose answer so far (that
output's logits; for an ensemble the mean of the logits of its members reached so far) gives its top class a
softmax probability of at least ``threshold`` stop there; the others go on with the stage's features. At the last
output every image stops, with the model's whole answer: a threshold above 1 gives exactly that.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.model_package import Manifest, ManifestError, ModelEntry, read_verified

__all__ = ["BACKENDS", "EarlyExit", "ModelRunner", "open_model", "softmax_confidence"]

BACKENDS = ("auto", "onnxruntime", "torch")
#: Images a forward pass takes at once.
BATCH = 100

Graph = Callable[[np.ndarray], list[np.ndarray]]


def softmax_confidence(logits: np.ndarray) -> np.ndarray:
    """The softmax probability of each row's top class."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    weights = np.exp(shifted)
    return np.asarray(1.0 / weights.sum(axis=1), dtype=np.float64)  # the top class's exp(0) over the sum


@dataclass(frozen=True)
class EarlyExit:
    """Early-exit inference's answer: each image's logits, the output it stopped at (0-based), and the
    multiply-accumulates it took."""

    logits: np.ndarray
    exits: np.ndarray
    macs: np.ndarray


def _onnx_graph(data: bytes) -> Graph:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(out) for out in session.run(None, {name: x})]

    return run


def _torch_graphs(folder: Path, manifest: Manifest, entry: ModelEntry) -> tuple[Graph, list[Graph]]:
    """The answer and the stages of ``entry`` in torch, built from its verified weights."""
    import torch
    from safetensors.torch import load as load_safetensors

    from models import SubmodelSpec, get_family
    from models.onnx_export import AnswerModule, StageModule, stages

    state = load_safetensors(read_verified(folder, entry.state))
    family = get_family(manifest.family, manifest.num_classes, manifest.input.channels, **manifest.model_options)
    net = family.build(SubmodelSpec.from_dict(entry.spec))
    net.load_state_dict(state, strict=True)
    net.eval()

    def graph(module: torch.nn.Module) -> Graph:
        @torch.no_grad()
        def run(x: np.ndarray) -> list[np.ndarray]:
            out = module(torch.from_numpy(np.ascontiguousarray(x)))
            return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]
        return run

    return graph(AnswerModule(net, entry.members)), [graph(StageModule(net, stage).eval()) for stage in stages(net)]


class ModelRunner:
    """One exported model, ready to answer (see the module docstring)."""

    def __init__(self, entry: ModelEntry, backend: str, answer: Graph,
                 stages: Callable[[], Sequence[Graph]] = lambda: ()) -> None:
        """``stages``: makes the stage graphs, called at the first early exit (a model run whole never loads
        them: their weights are the answer graph's again)."""
        self.entry = entry
        self.backend = backend
        self._answer = answer
        self._make_stages = stages
        self._loaded: list[Graph] | None = None

    @property
    def _stages(self) -> list[Graph]:
        if self._loaded is None:
            self._loaded = list(self._make_stages())
        return self._loaded

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The model's answer (logits) for normalised images ``x`` (``N x C x H x W``), the whole model run."""
        parts = [self._answer(np.ascontiguousarray(x[start:start + BATCH], dtype=np.float32))[0]
                 for start in range(0, len(x), BATCH)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)

    @property
    def has_exits(self) -> bool:
        """Whether an image can stop before the last output."""
        return self.entry.has_exits

    def early_exit(self, x: np.ndarray, threshold: float) -> EarlyExit:
        """Early-exit inference of ``x`` with confidence ``threshold`` (see the module docstring); a model without
        exits answers every image at its one output."""
        if not self.has_exits:
            logits = self.logits(x)
            count = len(logits)
            return EarlyExit(logits, np.zeros(count, dtype=np.int64), np.full(count, self.entry.macs, dtype=np.int64))
        count = len(x)
        logits = np.zeros((count, 0), dtype=np.float32)
        exits = np.full(count, -1, dtype=np.int64)
        members = set(self.entry.members)
        for start in range(0, count, BATCH):
            chunk = slice(start, min(start + BATCH, count))
            answered = self._early_exit_batch(np.ascontiguousarray(x[chunk], dtype=np.float32), threshold, members)
            if logits.shape[1] == 0:
                logits = np.zeros((count, answered[0].shape[1]), dtype=np.float32)
            logits[chunk], exits[chunk] = answered
        macs = np.asarray(self.entry.exit_macs, dtype=np.int64)[exits]
        return EarlyExit(logits, exits, macs)

    def _early_exit_batch(self, x: np.ndarray, threshold: float,
                          members: set[int]) -> tuple[np.ndarray, np.ndarray]:
        count = len(x)
        final: np.ndarray | None = None
        exits = np.full(count, len(self._stages) - 1, dtype=np.int64)
        waiting = np.arange(count)  # the images still going on, by index into the batch
        summed: np.ndarray | None = None  # an ensemble's logits summed over the members reached so far
        reached = 0
        features = x
        for number, stage in enumerate(self._stages):
            outputs = stage(features)
            last = number == len(self._stages) - 1
            logits = outputs[-1]  # a stage hands on its features first, unless it is the last
            if not last:
                features = outputs[0]
            if final is None:
                final = np.zeros((count, logits.shape[1]), dtype=np.float32)
            if self.entry.answer == "ensemble":
                if number in members:
                    summed = logits if summed is None else summed + logits
                    reached += 1
                if summed is None:
                    continue
                answer = summed / reached
            else:
                answer = logits
            stop = np.ones(len(waiting), dtype=bool) if last else softmax_confidence(answer) >= threshold
            final[waiting[stop]] = answer[stop]
            exits[waiting[stop]] = number
            waiting = waiting[~stop]
            if not len(waiting):
                break
            features = features[~stop]
            if summed is not None:
                summed = summed[~stop]
        assert final is not None
        return final, exits


def open_model(folder: str | Path, manifest: Manifest, entry: ModelEntry, backend: str = "auto") -> ModelRunner:
    """``entry`` of the model folder ``folder``, its files checked against their digests, run by ``backend``
    (``auto``: onnxruntime where it is installed, else torch); ManifestError (one sentence) for a missing or altered
    file or a backend that is not installed."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    folder = Path(folder)
    if backend == "auto":
        backend = "onnxruntime" if importlib.util.find_spec("onnxruntime") is not None else "torch"
    if backend == "onnxruntime":
        if importlib.util.find_spec("onnxruntime") is None:
            raise ManifestError("onnxruntime is not installed: pip install onnxruntime, or use the torch backend")
        answer = _onnx_graph(read_verified(folder, entry.onnx))
        return ModelRunner(entry, backend, answer,
                           lambda: [_onnx_graph(read_verified(folder, stage)) for stage in entry.stages])
    if importlib.util.find_spec("torch") is None:
        raise ManifestError("neither onnxruntime nor torch is installed: pip install onnxruntime")
    answer, stage_graphs = _torch_graphs(folder, manifest, entry)
    return ModelRunner(entry, backend, answer, lambda: stage_graphs if entry.has_exits else [])
