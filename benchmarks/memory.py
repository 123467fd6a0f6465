"""Training-memory estimator against the measured peak, side by side.

Run as ``.venv/bin/python benchmarks/memory.py`` (a benchmark, not a test: it prints, it never fails on a
number). For each model family, several sub-model specs and batch sizes, depth-wise rows (FeDepth: a spec with
segments, trained one after another with the blocks before each frozen; the measured peak is the child's
highest stage peak, the estimate that of the costliest stage) for the CNN, PreResNet-18 and PreResNet-20 (some
with two epochs a stage training from buffered frozen outputs, one through auxiliary classifiers, some in
micro-batches with accumulated gradients), rows
of several copies trained with mutual distillation (m-FeDepth), a few early-exit rows (ScaleFL levels trained
with self-distillation) and a few rows distilling from nested narrower sub-models (FlexFL's ``nested_kd``: lambda
10 shared by the teachers, tau 3) and a few of FjORD's ordered dropout (a width drawn per batch from a grid up to
the spec's, distilled from the spec: ``widths`` and a ``width_kd`` term), it prints the estimate of ``models.memory`` for the task's spec and training plan, the
measured peak, their ratio and the milliseconds per training step; the last line is ``worst ratio: X`` (the
ratio farthest from 1).

Every row is measured by the edge agent itself: a ``TaskRunner`` (``--allocator``, default ``pooled``, see
``edge_agent.allocator``; ``--threads`` torch threads) gets a task for the sub-model with random weights and
``--steps`` batches of random local data (one epoch; half as many samples for two epochs), trains it in its training child forked from the warm
forkserver, and the measured peak is the ``peak_bytes`` the child reports in the update: its RSS high-water mark
(reset at the start of training through ``/proc/self/clear_refs``) minus the RSS there, or the CUDA allocator's
peak on GPU.

With ``--allocator default`` (glibc's default heap) measured peaks on CPU vary between runs of one configuration
by up to about 10% (heap fragmentation depends on the address-space layout; see docs/edge-runtime.md); with
``pooled`` or ``compact`` they repeat to within about 0.4 MB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1e6
NUM_CLASSES = 10
#: cuDNN's own variable for its convolution workspace ("per allocation", MiB in common use), listed in PyTorch's CUDA
#: environment variables; the training children inherit it from this process. Whether cuDNN's heuristics honour it
#: under torch's v8 API is what a GPU run with it measures (torch never reads it).
CUDNN_WORKSPACE_CAP_ENV = "CUDNN_CONV_WSCAP_DBG"


#: scikit-learn's digits, the experiments' dataset (its rows say so in their label).
DIGITS_SIZE = (8, 8)


@dataclass(frozen=True)
class Row:
    family: str
    in_channels: int
    image_size: tuple[int, int]
    width: float
    batch_size: int
    segments: tuple[tuple[int, int], ...] | None = None  # depth-wise: these block ranges, in order
    exits: tuple[int, ...] = ()  # early exits, trained with ScaleFL's self-distillation
    depth: int | None = None
    copies: int = 1  # models trained side by side with mutual distillation
    route: str = "skip"  # depth-wise: how a segment reaches a classifier ("exit": the exits after segments)
    buffered: bool = False  # depth-wise: two epochs a stage, the frozen blocks' outputs buffered (Stage.cache)
    micro: int = 0  # depth-wise: micro-batches of this many samples, gradients accumulated (Stage.micro_batch)
    nested: tuple[float, ...] = ()  # FlexFL: uniform widths of the nested teachers (nested_kd terms)
    ordered: tuple[float, ...] = ()  # FjORD: the ordered-dropout widths (the plan's widths, with a width_kd term)

    @property
    def scalefl(self) -> bool:
        return bool(self.exits) and self.segments is None

    @property
    def epochs(self) -> int:
        return 2 if self.buffered else 1

    def spec(self) -> Any:
        from models import SubmodelSpec

        if self.scalefl:
            return SubmodelSpec(width=self.width, rounding="floor", depth=self.depth, exits=self.exits)
        return SubmodelSpec(width=self.width, segments=self.segments, exits=self.exits)

    def plan(self) -> Any:
        from coordinator.strategies.scalefl import self_distillation_loss
        from protocol import LossTerm, OptimizerSettings, Stage, TrainingPlan

        outputs = len(self.exits) + (self.depth is None) if self.scalefl else 1
        loss = self_distillation_loss(outputs, beta=0.1, tau=3.0) if self.scalefl else (LossTerm.ce(),)
        if self.copies > 1:
            loss = (*loss, LossTerm.mutual_kd(weight=1.0, tau=1.0))
        loss = (*loss, *(LossTerm.nested_kd(type(self.spec()).uniform(width).to_dict(), weight=10.0 / len(self.nested),
                                            tau=3.0) for width in self.nested))
        if self.ordered:
            loss = (*loss, LossTerm.width_kd())
        schedule = tuple(Stage(self.epochs, self.route, self.buffered, self.micro) for _ in self.segments or ())
        return TrainingPlan(optimizer=OptimizerSettings("sgd", 0.01, 0.9, 5e-4, 1.0), epochs=self.epochs,
                            batch_size=self.batch_size, loss=loss, copies=self.copies, schedule=schedule,
                            widths=self.ordered)

    def label(self) -> str:
        return (self.spec().describe() + (f" x{self.copies} copies" if self.copies > 1 else "")
                + (" buffered" if self.buffered else "") + (f" micro {self.micro}" if self.micro else "")
                + (" kd<" + ",".join(f"{width:g}" for width in self.nested) if self.nested else "")
                + (" od " + ",".join(f"{width:g}" for width in self.ordered) if self.ordered else "")
                + (f" {self.image_size[0]}x{self.image_size[1]}" if self.image_size == DIGITS_SIZE else ""))


def rows() -> list[Row]:
    out = [Row("cnn", 1, (28, 28), w, b) for w in (1, 0.5, 0.25, 0.125, 0.0625) for b in (10, 32, 128)]
    out += [Row("preresnet18", 3, (32, 32), w, b) for w in (1, 0.5, 0.25, 0.125) for b in (10, 32)]
    # digits (8x8), the experiments' dataset: the CNN's last blocks see 2x2 and 1x1 maps (PreResNet-20's 2x2), where
    # oneDNN on AVX2 computes weight gradients by GEMM, with scratch booked for more threads than run
    out += [Row("cnn", 1, DIGITS_SIZE, w, 32) for w in (1, 0.5)]
    out += [Row("preresnet20", 1, DIGITS_SIZE, 1, 32),
            Row("preresnet20", 1, DIGITS_SIZE, 0.5, 32, segments=((0, 3), (3, 9)))]
    out += [
        Row("cnn", 1, (28, 28), 1, 128, segments=((0, 1),)),
        Row("cnn", 1, (28, 28), 1, 32, segments=((2, 3),)),
        Row("cnn", 1, (28, 28), 1, 32, segments=((0, 1), (1, 3))),
        Row("preresnet18", 3, (32, 32), 1, 32, segments=((0, 1),)),
        Row("preresnet18", 3, (32, 32), 1, 32, segments=((3, 4),)),
        Row("preresnet18", 3, (32, 32), 0.5, 32, segments=((7, 8),)),
        Row("preresnet18", 3, (32, 32), 1, 32, segments=((0, 2), (2, 5), (5, 8))),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 1),)),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((4, 5),)),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((8, 9),)),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 1), (1, 2), (2, 5), (5, 9))),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((3, 5), (5, 9))),
        Row("preresnet20", 1, (28, 28), 1, 32),
        Row("cnn", 1, (28, 28), 1, 32, segments=((0, 1), (1, 3)), buffered=True),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 3), (3, 5), (5, 9)), buffered=True),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 3), (3, 9)), exits=(2,), route="exit"),
        Row("cnn", 1, (28, 28), 1, 128, segments=((0, 1),), micro=32),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 1),), micro=16),
        Row("preresnet20", 1, (28, 28), 1, 32, segments=((0, 3), (3, 9)), micro=8),
        Row("cnn", 1, (28, 28), 1, 32, copies=2),
        Row("preresnet20", 1, (28, 28), 1, 32, copies=2),
        Row("cnn", 1, (28, 28), 0.76, 32, exits=(0, 2), depth=3),
        Row("cnn", 1, (28, 28), 1, 32, exits=(0, 2)),
        Row("resnet20", 1, (28, 28), 0.6, 32, exits=(1, 2, 4), depth=5),
        Row("cnn", 1, (28, 28), 1, 32, nested=(0.5, 0.25, 0.125)),
        Row("cnn", 1, (28, 28), 1, 128, nested=(0.5,)),
        Row("preresnet18", 3, (32, 32), 0.5, 32, nested=(0.25, 0.125)),
        Row("cnn", 1, (28, 28), 1, 32, ordered=(1.0, 0.8, 0.6, 0.4, 0.2)),
        Row("cnn", 1, (28, 28), 0.6, 128, ordered=(0.6, 0.4, 0.2)),
        Row("preresnet20", 1, (28, 28), 1, 32, ordered=(1.0, 0.8, 0.6, 0.4, 0.2)),
    ]
    return out


def measure_with_agent(
    row: Row, device: str, steps: int, threads: int, allocator: str, state_dir: Path
) -> dict[str, float]:
    """The metrics of one training task run by the agent's ``TaskRunner`` (``peak_bytes``, ``seconds``,
    ``steps``, and ``stage_peak_bytes.<i>`` for depth-wise rows)."""
    import numpy as np
    import torch

    from edge_agent.runner import LocalData, TaskRunner
    from models import get_family
    from protocol import ModelRef, Task

    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    spec = row.spec()
    torch.manual_seed(0)
    full = family.build(type(spec)(exits=spec.exits)).state_dict()
    weights = family.extract(full, spec, keys=family.state_keys(spec))
    samples = steps * row.batch_size // row.epochs
    data = LocalData(torch.randn(samples, row.in_channels, *row.image_size).numpy(),
                     (torch.arange(samples) % NUM_CLASSES).numpy())
    task = Task(task_id=f"bench-{time.monotonic_ns()}", round=1, agent_id="bench", deadline=time.time() + 3600,
                model=ModelRef(row.family, NUM_CLASSES, row.in_channels, {}), spec=spec.to_dict(), recipe=None,
                weights={key: np.ascontiguousarray(value.numpy()) for key, value in weights.items()},
                adaptation=None, plan=row.plan())
    runner = TaskRunner("bench", data, None, device, state_dir=state_dir, torch_threads=threads,
                        allocator=allocator)
    update = runner.run(task)
    if update.status != "ok":
        raise RuntimeError(f"the agent did not train {row}: {update.status}: {update.reason}")
    return update.metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per measurement (default 20)")
    parser.add_argument("--allocator", choices=("pooled", "compact", "default"), default="pooled",
                        help="heap of the training child on CPU, the agent's allocator setting (default pooled)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the training child (default 1)")
    parser.add_argument("--match", default="", help="only the rows whose 'family spec' contains this text")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the agent trains: auto (the CPU, and CUDA too where torch sees a GPU), cpu or cuda")
    parser.add_argument("--cudnn-workspace-cap", type=int, default=None, metavar="MIB",
                        help="cap cuDNN's convolution workspace at MIB MiB per allocation in the training children "
                             "(cuDNN's CUDNN_CONV_WSCAP_DBG, set before any forkserver starts; CUDA rows only)")
    args = parser.parse_args(argv)
    if args.cudnn_workspace_cap is not None:
        if args.cudnn_workspace_cap < 0:
            parser.error("--cudnn-workspace-cap must be a number of MiB, 0 or more")
        os.environ[CUDNN_WORKSPACE_CAP_ENV] = str(args.cudnn_workspace_cap)
        print(f"cuDNN's convolution workspace capped at {args.cudnn_workspace_cap} MiB ({CUDNN_WORKSPACE_CAP_ENV})")

    import torch

    from edge_agent import allocator as heap
    from models import estimate_plan_memory, estimate_plan_stages, get_family

    allocator = heap.resolve(args.allocator)
    if allocator != args.allocator:
        print(f"allocator {args.allocator!r} is not available here (no glibc mallopt, or no page pool); "
              f"measuring {allocator!r}")
    devices = {"auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else []), "cpu": ["cpu"],
               "cuda": ["cuda"]}[args.device]
    header = (
        f"{'device':6s} {'family':12s} {'spec':34s} {'batch':>5s} {'estimate MB':>12s} {'measured MB':>12s} "
        f"{'ratio':>6s} {'ms/step':>8s}" + (f" {'reserved MB':>12s} {'context MB':>11s}" if "cuda" in devices else "")
    )
    print(header)
    print("-" * len(header))
    worst = 1.0
    started = time.monotonic()
    chosen = [row for row in rows() if args.match in f"{row.family} {row.label()}"]
    with tempfile.TemporaryDirectory(prefix="fedfit-bench-") as state_dir:
        for device in devices:
            for row in chosen:
                family = get_family(row.family, NUM_CLASSES, row.in_channels)
                spec = row.spec()
                samples = args.steps * row.batch_size // row.epochs
                estimate = estimate_plan_memory(family, spec, row.plan(), input_size=row.image_size, device=device,
                                                allocator=allocator, samples=samples, threads=args.threads).total
                metrics = measure_with_agent(row, device, args.steps, args.threads, allocator, Path(state_dir))
                measured, seconds = metrics["peak_bytes"], metrics["seconds"] / metrics["steps"]
                ratio = estimate / measured
                if abs(ratio - 1) > abs(worst - 1):
                    worst = ratio
                label = row.label()
                cuda = (f" {metrics.get('cuda_reserved_peak_bytes', 0) / MB:12.2f}"
                        f" {metrics.get('cuda_context_bytes', float('nan')) / MB:11.1f}") if device == "cuda" else ""
                print(
                    f"{device:6s} {row.family:12s} {label:34s} {row.batch_size:5d} {estimate / MB:12.2f} "
                    f"{measured / MB:12.2f} {ratio:6.3f} {seconds * 1000:8.0f}{cuda}",
                    flush=True,
                )
                stage_estimates = estimate_plan_stages(family, spec, row.plan(), input_size=row.image_size,
                                                       device=device, allocator=allocator, samples=samples,
                                                       threads=args.threads)
                for index, segment in enumerate(spec.segments or ()):  # every stage of a depth-wise run
                    if len(spec.segments) == 1:
                        break
                    stage = stage_estimates[index].total
                    stage_measured = metrics[f"stage_peak_bytes.{index}"]
                    print(f"{'':6s} {'':12s} {'  stage ' + str(index) + ': blocks ' + str(segment):34s} "
                          f"{'':5s} {stage / MB:12.2f} {stage_measured / MB:12.2f} {stage / stage_measured:6.3f}",
                          flush=True)
    print(f"({len(chosen) * len(devices)} rows, allocator {allocator}, {args.steps} steps each, "
          f"{time.monotonic() - started:.0f} s)")
    print(f"worst ratio: {worst:.3f}")


if __name__ == "__main__":
    main()
