"""``fedfit export RUN_DIR``: the deployable models of a finished run, written for the devices that run them.

Every level some device trained (the global model, each level, DepthFL's ensemble), cut from the run's last
checkpoint exactly as its coordinator evaluated it (:mod:`coordinator.deployment`), or only those ``--level`` names,
or the largest one a device with ``--budget`` MiB for inference can run. Each is written as ONNX (the whole model,
and one graph per stage between early exits) and safetensors, with a manifest (:mod:`common.model_package`). Then
every exported ONNX graph is run through onnxruntime on the run's own test images, and its accuracy printed beside
the run's report: they agree, or the command fails saying by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import from_mapping, load_yaml
from common.model_package import MANIFEST

__all__ = ["FinishedRun", "add_parser", "load_run", "run"]

#: Largest difference between an exported model's accuracy through onnxruntime and the run's (or torch's) figure.
TOLERANCE = 1e-4


def add_parser(sub: Any) -> None:
    """The ``export`` sub-command's arguments."""
    export = sub.add_parser(
        "export", help="write a finished run's deployable models as ONNX and safetensors, with a manifest",
        description="Write the deployable models of a finished run (each level some device trained, cut from its "
                    "last checkpoint as its coordinator evaluated it) as ONNX and safetensors with a manifest, then "
                    "check each through onnxruntime against the run's report.")
    export.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run's directory (fedfit sim's), or a coordinator's state_dir with --config")
    export.add_argument("--out", default=None, metavar="DIR",
                        help="where the models go (default: RUN_DIR/models; a model folder there is replaced)")
    export.add_argument("--level", action="append", default=[], metavar="NAME", dest="levels",
                        help="export only this level (repeatable; 'global' is the global model)")
    export.add_argument("--budget", type=float, default=None, metavar="MIB",
                        help="export only the largest trained level whose inference needs at most MIB mebibytes")
    export.add_argument("--untrained", action="store_true",
                        help="also export levels no device trained (their accuracy is that of an untrained model)")
    export.add_argument("--config", default=None, metavar="FILE",
                        help="the coordinator's YAML (default: the configuration RUN_DIR/report.json keeps)")


@dataclass
class FinishedRun:
    """What a run's directory holds, loaded as its coordinator had it after its last round."""

    config: Any
    dataset: Any
    family: Any
    strategy: Any
    states: dict[str, Any]
    completed: int
    record: Any
    trained: Any
    evaluator: Any


def _config(run_dir: Path, config_path: str | None) -> Any:
    from coordinator.config import CoordinatorConfig

    if config_path is not None:
        mapping = load_yaml(config_path)
        mapping.pop("experiment", None)
    else:
        report = run_dir / "report.json"
        try:
            mapping = json.loads(report.read_text())["run"]["config"]
        except FileNotFoundError:
            raise ValueError(f"{run_dir} has no report.json (a coordinator's state_dir, or a run stopped before its "
                             f"end): give its configuration with --config") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the run's configuration from {report}: {exc!r}") from None
        mapping.pop("broker", None)  # the report keeps its address only; exporting needs none
    return from_mapping(CoordinatorConfig, mapping, where="")


def load_run(run_dir: str | Path, config_path: str | None = None) -> FinishedRun:
    """The run in ``run_dir`` after its last checkpointed round; ValueError (one sentence) when it has finished no
    round or its files do not belong together."""
    from common.data import load_dataset
    from common.logs import get_logger
    from coordinator.checkpoint import checkpoint_metadata, restore_checkpoint
    from coordinator.deployable import TrainedSoFar
    from coordinator.evaluation import Evaluator
    from coordinator.metrics import RoundResult
    from coordinator.planning import model_family, strategy_for

    folder = Path(run_dir)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory: give a run's directory")
    checkpoint = folder / "checkpoint.safetensors"
    if not checkpoint.is_file():
        raise ValueError(f"{folder} holds no finished round (no checkpoint.safetensors): there is nothing to export")
    config = _config(folder, config_path)
    config.resume = True
    config.validate()
    dataset = load_dataset(config.data.dataset, config.data.root)
    family = model_family(config, dataset)
    strategy = strategy_for(config, dataset, family)
    states, completed = restore_checkpoint(checkpoint, config, strategy)
    if completed < 1:
        raise ValueError(f"{folder} holds no finished round: there is nothing to export")
    raw = checkpoint_metadata(checkpoint).get("record")
    record = RoundResult.from_dict(raw) if raw else None
    trained = TrainedSoFar.of_run(folder / "metrics.jsonl", completed, get_logger("export"))
    evaluator = Evaluator.for_test_set(family, dataset, config.data.eval_samples, config.seed,
                                       strategy.context.server_x)
    return FinishedRun(config, dataset, family, strategy, states, completed, record, trained, evaluator)


def _within_budget(loaded: FinishedRun, budget_mib: float) -> list[str]:
    """The name of the largest trained model whose inference fits ``budget_mib`` (by parameters; the deployable
    model where two tie)."""
    from coordinator.deployment import model_groups
    from models.inference_memory import estimate_inference_memory

    fitting = [group for group in model_groups(loaded.strategy.eval_targets(), loaded.family, loaded.trained)
               if group.trained and estimate_inference_memory(loaded.family, group.target.spec,
                                                              loaded.dataset.image_size) <= budget_mib * 2**20]
    if not fitting:
        raise ValueError(f"no trained level of this run runs within {budget_mib:g} MiB of memory; give a larger "
                         f"--budget")
    return [max(fitting, key=lambda group: (loaded.family.param_count(group.target.spec), group.deployed)).name]


def run(args: argparse.Namespace) -> int:
    """Export, check and print the table; 0 when every model agrees with the run, 1 when one does not."""
    from common.inference import open_model
    from coordinator.deployment import cut_models, write_models
    from coordinator.planning import model_options

    out = (Path(args.out) if args.out else Path(args.run_dir) / "models").resolve()
    # A model folder there (the one the coordinator wrote at the federation's end, an earlier export) is made again from
    # the checkpoint and replaced whole; anything else is not this command's to replace.
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise ValueError(f"{out} holds files that are not a model folder: give another --out")
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget must be a positive number of MiB, got {args.budget:g}")
    loaded = load_run(args.run_dir, args.config)
    names = _within_budget(loaded, args.budget) if args.budget is not None else list(args.levels)
    targets = loaded.strategy.eval_targets()
    models, left_out = cut_models(targets, loaded.states, loaded.family, loaded.evaluator, loaded.trained,
                                  loaded.record, names=names, untrained=args.untrained)
    for name in left_out:
        print(f"fedfit export: {name} left out: no device trained it (--untrained exports it anyway)", file=sys.stderr)
    for model in models:
        if not model.trained:
            print(f"fedfit export: warning: {model.name} was trained by no device; its outputs are those of its "
                  f"initial weights", file=sys.stderr)
    if not models:
        raise ValueError("no level to export: no device trained the ones asked for (--untrained exports them)")
    # Written beside it and renamed when whole: an interrupted export leaves no folder that looks finished.
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    manifest = write_models(partial, models, loaded.family, loaded.dataset, loaded.evaluator,
                            algorithm=loaded.config.algorithm, family_name=loaded.config.model.family,
                            model_options=model_options(loaded.config), round_number=loaded.completed,
                            source=str(Path(args.run_dir).resolve()),
                            progress=lambda name: print(f"fedfit export: {name}...", file=sys.stderr, flush=True))
    replaced = out.with_name(f".{out.name}.replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if out.exists():
        os.replace(out, replaced)
    os.replace(partial, out)
    shutil.rmtree(replaced, ignore_errors=True)
    x = loaded.evaluator.test_x.numpy()
    y = loaded.evaluator.test_y.numpy()
    failed = 0
    rows = []
    for entry in manifest.models:
        runner = open_model(out, manifest, entry)
        onnx_accuracy = float((runner.logits(x).argmax(axis=1) == y).mean())
        reference = entry.accuracy if entry.accuracy is not None else entry.exit_accuracy[-1]
        agrees = abs(onnx_accuracy - reference) <= TOLERANCE
        failed += not agrees
        rows.append((entry, onnx_accuracy, agrees, runner.backend))
    _print_table(manifest, rows, out)
    if failed:
        print(f"fedfit export: {failed} model(s) differ from the run's figure by more than {TOLERANCE:g}",
              file=sys.stderr)
    return 1 if failed else 0


def _print_table(manifest: Any, rows: list[tuple[Any, float, bool, str]], out: Path) -> None:
    print(f"{manifest.algorithm} on {manifest.family}, round {manifest.round}: {len(rows)} model(s) in {out}")
    print(f"{'model':<10} {'params':>9} {'MMACs':>8} {'infer MiB':>9} {'outputs':>7} {'report':>7} "
          f"{'onnx':>7}  note")
    for entry, accuracy, agrees, backend in rows:
        report = f"{entry.accuracy:.4f}" if entry.accuracy is not None else "-"
        notes = [note for note, on in (("deployed", entry.deployed), ("UNTRAINED", not entry.trained),
                                       (f"also {', '.join(entry.aliases)}", bool(entry.aliases)),
                                       (f"{backend}", backend != "onnxruntime"),
                                       ("DIFFERS", not agrees)) if on]
        print(f"{entry.name:<10} {entry.parameters:>9,} {entry.macs / 1e6:>8.3f} "
              f"{entry.inference_bytes / 2**20:>9.2f} {entry.outputs:>7} {report:>7} {accuracy:>7.4f}  "
              f"{'; '.join(notes)}")
