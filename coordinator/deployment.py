"""The models a run hands its devices: every evaluation target of the method (its levels, the global model, its
ensemble) cut from the global state exactly as the coordinator evaluates it (the sub-model's slice, its static-BN
statistics recomputed on the server sample, its exits), written as a model folder (:mod:`common.model_package`):
an ONNX graph of its answer, its stages between exits, and its weights in safetensors.

Used by ``fedfit export`` on a finished run and by the coordinator at the end of a federation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from common.data import Dataset
from common.model_package import InputSpec, Manifest, ModelEntry, write_file, write_manifest
from coordinator.deployable import GLOBAL, TrainedSoFar, deployed_name
from coordinator.evaluation import Evaluator, accuracies
from coordinator.metrics import RoundResult
from coordinator.tasks import EvalTarget, State
from models import FamilyNet, ModelFamily, SubmodelSpec
from models.inference_memory import estimate_inference_memory
from models.onnx_export import export_answer, export_stages

__all__ = ["CutModel", "ModelGroup", "answer_macs", "cut_models", "ensemble_spec", "is_trained", "model_groups",
           "output_macs", "write_models"]


@dataclass
class CutModel:
    """One deployable model of a run: the target ``name`` (and the other targets that are the same model,
    ``aliases``), the sub-model with its BN statistics, what it answers (``members``: an ensemble's outputs,
    0-based; none: its last output), whether some device trained it, whether it is the run's deployable model, and
    the run's own accuracy for it (None where its last round did not evaluate it)."""

    name: str
    aliases: tuple[str, ...]
    spec: SubmodelSpec
    net: FamilyNet
    members: tuple[int, ...]
    trained: bool
    deployed: bool
    accuracy: float | None


def is_trained(name: str, target: EvalTarget, family: ModelFamily, trained: TrainedSoFar,
               same: Iterable[str] = ()) -> bool:
    """Whether some aggregated update of the run trained the evaluation target ``name`` (``same``: the targets that
    are the same model): a level as such (the global model: a level that is it, where one is; else its last
    output), or some classifier of an ensemble."""
    if target.ensemble:
        return bool(trained.exits)
    levels = {name, *same} - {GLOBAL}
    if levels:
        return bool(levels & trained.levels)
    return family.num_outputs(target.spec) in trained.exits


def _report_accuracy(name: str, record: RoundResult | None) -> float | None:
    if record is None:
        return None
    if name == GLOBAL:
        return record.global_accuracy
    return record.level_accuracy.get(name)


@dataclass(frozen=True)
class ModelGroup:
    """One model of a run's evaluation targets: the name it goes by (the deployable model's name where it is that
    model, else its first target's), its other names, its target, whether some device trained it and whether it is
    the run's deployable model."""

    name: str
    aliases: tuple[str, ...]
    target: EvalTarget
    trained: bool
    deployed: bool

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def model_groups(targets: Mapping[str, EvalTarget], family: ModelFamily, trained: TrainedSoFar) -> list[ModelGroup]:
    """The run's evaluation ``targets`` as models, each once (a level that is the global model is its alias)."""
    chosen = deployed_name(targets, family, trained)
    groups: dict[tuple[str, SubmodelSpec, bool], list[str]] = {}
    for name, target in targets.items():
        groups.setdefault((target.group, target.spec, target.ensemble), []).append(name)
    found = []
    for same in groups.values():
        name = chosen if chosen in same else same[0]
        found.append(ModelGroup(name, tuple(other for other in same if other != name), targets[name],
                                is_trained(name, targets[name], family, trained, same), name == chosen))
    return found


def ensemble_spec(spec: SubmodelSpec, family: ModelFamily, members: Sequence[int]) -> SubmodelSpec:
    """``spec`` cut after the last of its outputs ``members`` (0-based): the blocks and heads after it take no part
    in the ensemble's answer (DepthFL's deepest classifiers where no device trained them)."""
    exits = sorted(family.validate_spec(spec).exits)
    last = max(members)
    if last >= len(exits):  # the final head is a member: the whole model
        return spec
    return replace(spec, depth=exits[last] + 1, exits=tuple(exits[:last + 1]))


def cut_models(targets: Mapping[str, EvalTarget], states: Mapping[str, State], family: ModelFamily,
               evaluator: Evaluator, trained: TrainedSoFar, record: RoundResult | None, *,
               names: Iterable[str] = (), untrained: bool = False) -> tuple[list[CutModel], list[str]]:
    """The run's deployable models among its evaluation ``targets`` (those ``names`` only, when given), each model
    once (:func:`model_groups`), and the names left out because no device trained them (all kept with
    ``untrained``). ``record``: the run's last round (the accuracies it reported). An ensemble is cut after its
    last member (:func:`ensemble_spec`)."""
    wanted = list(names)
    unknown = [name for name in wanted if name not in targets]
    if unknown:
        raise ValueError(f"no level {', '.join(map(repr, unknown))} in this run; it has {', '.join(targets)}")
    models: list[CutModel] = []
    left_out: list[str] = []
    for group in model_groups(targets, family, trained):
        if wanted and not set(group.names) & set(wanted):
            continue
        if not group.trained and not untrained:
            left_out.append(group.name)
            continue
        spec = group.target.spec
        members: tuple[int, ...] = ()
        if group.target.ensemble:
            members = tuple(trained.members() or range(family.num_outputs(spec)))
            spec = ensemble_spec(spec, family, members)
        models.append(CutModel(group.name, group.aliases, spec, evaluator.prepare(states[group.target.group], spec),
                               members, group.trained, group.deployed, _report_accuracy(group.name, record)))
    return models, left_out


def output_macs(family: ModelFamily, net: FamilyNet, spec: SubmodelSpec, input_size: tuple[int, int]) -> list[int]:
    """The multiply-accumulates of one image through ``net`` (the sub-model ``spec``) up to and including each of
    its outputs (depth order), the heads of the outputs before it included: what early-exit inference that stops
    there has computed."""
    costs = family.layer_costs(spec, input_size)
    outputs: list[int | None] = [*net.exit_blocks, *([None] if net.head is not None else [])]
    totals: list[int] = []
    heads = 0
    for output in outputs:
        last_block = len(net.blocks) - 1 if output is None else output
        body = sum(macs for decl, _, macs in costs if decl.block is not None and decl.block <= last_block)
        heads += sum(macs for decl, _, macs in costs if decl.block is None and decl.exit == output)
        totals.append(body + heads)
    return totals


def answer_macs(family: ModelFamily, net: FamilyNet, spec: SubmodelSpec, input_size: tuple[int, int],
                ensemble: bool) -> int:
    """Multiply-accumulates of one image through ``net``'s answer: every output for an ensemble, else its body and
    its last output's head alone."""
    if ensemble:
        return family.flops(spec, input_size)
    last = None if net.head is not None else net.exit_blocks[-1]
    return sum(macs for decl, _, macs in family.layer_costs(spec, input_size)
               if decl.block is not None or decl.exit == last)


def _measured(model: CutModel, evaluator: Evaluator) -> tuple[float, ...]:
    """Each output's accuracy on the evaluator's test images (then the ensemble's, for an ensemble)."""
    return tuple(accuracies(model.net, evaluator.test_x, evaluator.test_y, ensemble=bool(model.members),
                            members=model.members))


def write_models(folder: str | Path, models: Sequence[CutModel], family: ModelFamily, dataset: Dataset,
                 evaluator: Evaluator, *, algorithm: str, family_name: str, model_options: Mapping[str, object],
                 round_number: int, source: str, progress: Callable[[str], None] | None = None) -> Manifest:
    """Write ``models`` into ``folder`` (one sub-folder each: ``model.onnx``, ``stages/output-<i>.onnx`` where it
    has exits, ``model.safetensors``) and then its manifest; returns the manifest."""
    folder = Path(folder)
    input_shape = (dataset.in_channels, *dataset.image_size)
    entries: list[ModelEntry] = []
    for model in models:
        if progress is not None:
            progress(model.name)
        net = model.net.to(memory_format=torch.contiguous_format).eval()
        base = f"{model.name}"
        onnx = write_file(folder, f"{base}/model.onnx", export_answer(net, input_shape, model.members))
        staged = export_stages(net, input_shape) if net.num_outputs > 1 else []
        stage_files = tuple(write_file(folder, f"{base}/stages/output-{number}.onnx", graph)
                            for number, graph in enumerate(staged, start=1))
        meta = {"format": "fedfit-model-state-v1", "family": family_name, "spec": json.dumps(model.spec.to_dict()),
                "model_options": json.dumps(dict(model_options), sort_keys=True),
                "num_classes": str(family.num_classes), "in_channels": str(family.in_channels)}
        state = {key: value.detach().contiguous().cpu() for key, value in net.state_dict().items()}
        weights = write_file(folder, f"{base}/model.safetensors", safetensors_bytes(state, metadata=meta))
        exits = output_macs(family, net, model.spec, dataset.image_size)
        entries.append(ModelEntry(
            name=model.name, spec=model.spec.to_dict(), parameters=family.param_count(model.spec),
            macs=answer_macs(family, net, model.spec, dataset.image_size, bool(model.members)), outputs=net.num_outputs,
            answer="ensemble" if model.members else "last", members=model.members, exit_macs=tuple(exits),
            accuracy=model.accuracy, exit_accuracy=_measured(model, evaluator), trained=model.trained,
            deployed=model.deployed,
            inference_bytes=estimate_inference_memory(family, model.spec, dataset.image_size),
            onnx=onnx, state=weights, stages=stage_files, aliases=model.aliases))
    manifest = Manifest(algorithm=algorithm, family=family_name, model_options=dict(model_options),
                        num_classes=family.num_classes, round=round_number, source=source,
                        input=InputSpec(dataset.in_channels, *dataset.image_size, *dataset.normalization),
                        classes=dataset.class_names or tuple(str(label) for label in range(family.num_classes)),
                        models=tuple(entries))
    write_manifest(folder, manifest)
    return manifest
