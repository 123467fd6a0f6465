"""Training-memory estimator against the measured peak, side by side.

Run as ``.venv/bin/python benchmarks/memory.py`` (a benchmark, not a test: it prints, it never fails on a
number). For each model family, several sub-model specs and batch sizes (and a few depth-wise block-training
rows), it prints the estimate of ``models.memory``, the measured peak, their ratio and the milliseconds per
training step; the last line is ``worst ratio: X`` (the ratio farthest from 1).

Whole-model rows are measured by the edge agent itself: a ``TaskRunner`` (``--allocator``, default ``compact``,
see ``edge_agent.allocator``; ``--threads`` torch threads) gets a task for the sub-model with random weights and
``--steps`` batches of random local data (one epoch), trains it in its training child forked from the warm
forkserver, and the measured peak is the ``peak_bytes`` the child reports in the update: its RSS high-water mark
(reset at the start of training through ``/proc/self/clear_refs``) minus the RSS there, or the CUDA allocator's
peak on GPU. Depth-wise block rows (the agent has no block-training recipe yet) are measured the same way by
:func:`measure_block_training_peak` in a child of the same forkserver.

With ``--allocator default`` (glibc's default heap) measured peaks on CPU vary between runs of one configuration
by up to about 10% (heap fragmentation depends on the address-space layout; see ``models/memory.py``); with
``compact`` they repeat to within about 0.4 MB.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1e6
NUM_CLASSES = 10


@dataclass(frozen=True)
class Row:
    family: str
    in_channels: int
    image_size: tuple[int, int]
    width: float
    batch_size: int
    block: int | None = None


def rows() -> list[Row]:
    out = [Row("cnn", 1, (28, 28), w, b) for w in (1, 0.5, 0.25, 0.125, 0.0625) for b in (10, 32, 128)]
    out += [Row("preresnet18", 3, (32, 32), w, b) for w in (1, 0.5, 0.25, 0.125) for b in (10, 32)]
    out += [
        Row("cnn", 1, (28, 28), 1, 128, block=0),
        Row("cnn", 1, (28, 28), 1, 32, block=2),
        Row("preresnet18", 3, (32, 32), 1, 32, block=0),
        Row("preresnet18", 3, (32, 32), 1, 32, block=4),
        Row("preresnet18", 3, (32, 32), 0.5, 32, block=8),
    ]
    return out


def _recipe(batch_size: int) -> Any:
    from protocol import Recipe

    return Recipe(epochs=1, batch_size=batch_size, lr=0.01, momentum=0.9, weight_decay=5e-4, clip_norm=1.0,
                  masked_ce=False, seed=0)


def measure_with_agent(
    row: Row, device: str, steps: int, threads: int, allocator: str, state_dir: Path
) -> tuple[int, float]:
    """(peak bytes, seconds per step) of one training task run by the agent's ``TaskRunner``."""
    import numpy as np
    import torch

    from edge_agent.runner import LocalData, TaskRunner
    from models import SubmodelSpec, get_family
    from protocol import ModelRef, Task

    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    spec = SubmodelSpec.uniform(row.width)
    torch.manual_seed(0)
    weights = family.extract(family.build().state_dict(), spec, keys=family.trainable_keys(spec))
    samples = steps * row.batch_size
    data = LocalData(torch.randn(samples, row.in_channels, *row.image_size), torch.arange(samples) % NUM_CLASSES)
    recipe = _recipe(row.batch_size)
    task = Task(task_id=f"bench-{time.monotonic_ns()}", round=1, agent_id="bench", deadline=time.time() + 3600,
                model=ModelRef(row.family, NUM_CLASSES, row.in_channels, {}), spec=spec.to_dict(), recipe=recipe,
                weights={key: np.ascontiguousarray(value.numpy()) for key, value in weights.items()},
                adaptation=None)
    runner = TaskRunner("bench", data, None, device, state_dir=state_dir, torch_threads=threads,
                        allocator=allocator)
    update = runner.run(task)
    if update.status != "ok":
        raise RuntimeError(f"the agent did not train {row}: {update.status}: {update.reason}")
    return int(update.metrics["peak_bytes"]), update.metrics["seconds"] / update.metrics["steps"]


def measure_block_training_peak(
    row: Row, shapes: dict[str, tuple[int, ...]], device: str, steps: int, threads: int, allocator: str
) -> tuple[int, float]:
    """(peak bytes, seconds per step) of depth-wise training ``row.block``, measured in THIS process as the
    agent's training child measures (run it in a fresh child of the forkserver).

    Like the child: the heap is set up for ``allocator``, the local data and the received weights (``shapes``)
    exist, one warm-up step of a batch on a throwaway copy has mapped the code and trimmed the heap
    (``edge_agent.child.warm_up_training``), the RSS high-water mark is reset; then the model is built, loaded
    and trained for ``steps`` batches by the agent's own training loop (``edge_agent.training.train_plain``; the
    frozen parameters get no gradient and no optimizer state).
    """
    import numpy as np
    import torch
    from edge_agent.training import train_plain

    from edge_agent import allocator as heap
    from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes, warm_up_training
    from models import SubmodelSpec, block_training_model, get_family

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    if not cuda:
        heap.configure(allocator)
    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    spec = SubmodelSpec.uniform(row.width)
    samples = steps * row.batch_size
    rng = np.random.default_rng(0)
    # Data and weights made by numpy, as the child receives them: no torch kernel runs before the baseline.
    x = torch.from_numpy(rng.standard_normal((samples, row.in_channels, *row.image_size), dtype=np.float32))
    y = torch.from_numpy(np.arange(samples) % NUM_CLASSES)
    recipe = _recipe(row.batch_size)
    weights = {key: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05) for key, shape in shapes.items()}
    for key, value in weights.items():
        if value.ndim == 1 and key.endswith("weight"):  # batch-norm scales near 1
            value += np.float32(1.0)
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context exists before the baseline
        torch.cuda.synchronize()
    assert row.block is not None
    block = row.block

    def build() -> torch.nn.Module:
        return block_training_model(family, family.build(spec, track_bn_stats=False).to(device), block,
                                    row.image_size)

    warm_up_training(build, x, y, recipe, list(range(NUM_CLASSES)), NUM_CLASSES, device, allocator)  # as the child
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict({key: torch.from_numpy(value) for key, value in weights.items()})
    model.to(device)  # all of the sub-model's weights, skipped blocks too, as the estimate assumes
    net = block_training_model(family, model, block, row.image_size)
    result = train_plain(net, x, y, recipe, list(range(NUM_CLASSES)), NUM_CLASSES, device)
    if cuda:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - baseline), result.seconds / result.steps
    return peak_rss_bytes() - baseline, result.seconds / result.steps


def _measure(row: Row, device: str, steps: int, threads: int, allocator: str, state_dir: Path) -> tuple[int, float]:
    if row.block is None:
        return measure_with_agent(row, device, steps, threads, allocator, state_dir)
    import torch

    from edge_agent.child import process_context
    from models import SubmodelSpec, get_family

    family = get_family(row.family, NUM_CLASSES, row.in_channels)
    with torch.device("meta"):
        model = family.build(SubmodelSpec.uniform(row.width), track_bn_stats=False)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    with process_context().Pool(1) as pool:  # forked from the agent's warm training forkserver
        peak, seconds = pool.apply(measure_block_training_peak, (row, shapes, device, steps, threads, allocator))
    return int(peak), float(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per measurement (default 20)")
    parser.add_argument("--allocator", choices=("compact", "default"), default="compact",
                        help="heap of the training child on CPU, the agent's allocator setting (default compact)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the training child (default 1)")
    args = parser.parse_args(argv)

    import torch

    from edge_agent import allocator as heap
    from models import SubmodelSpec, get_family

    allocator = heap.resolve(args.allocator)
    if allocator != args.allocator:
        print(f"allocator {args.allocator!r} is not available here (no glibc mallopt); measuring {allocator!r}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    header = (
        f"{'device':6s} {'family':12s} {'spec':22s} {'batch':>5s} {'estimate MB':>12s} {'measured MB':>12s} "
        f"{'ratio':>6s} {'ms/step':>8s}"
    )
    print(header)
    print("-" * len(header))
    worst = 1.0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedfit-bench-") as state_dir:
        for device in devices:
            for row in rows():
                family = get_family(row.family, NUM_CLASSES, row.in_channels)
                spec = SubmodelSpec.uniform(row.width)
                options: dict[str, Any] = {"batch_size": row.batch_size, "input_size": row.image_size,
                                           "device": device, "allocator": allocator}
                if row.block is None:
                    estimate = family.training_memory_bytes(spec, **options)
                else:
                    estimate = family.block_training_memory_bytes(spec, row.block, **options)
                measured, seconds = _measure(row, device, args.steps, args.threads, allocator, Path(state_dir))
                ratio = estimate / measured
                if abs(ratio - 1) > abs(worst - 1):
                    worst = ratio
                described = spec.describe() + ("" if row.block is None else f" block={row.block}")
                print(
                    f"{device:6s} {row.family:12s} {described:22s} {row.batch_size:5d} {estimate / MB:12.2f} "
                    f"{measured / MB:12.2f} {ratio:6.3f} {seconds * 1000:8.0f}",
                    flush=True,
                )
    print(f"({len(rows()) * len(devices)} rows, allocator {allocator}, {args.steps} steps each, "
          f"{time.monotonic() - started:.0f} s)")
    print(f"worst ratio: {worst:.3f}")


if __name__ == "__main__":
    main()
