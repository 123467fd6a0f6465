"""Training-memory estimator against the measured peak, side by side.

Run as ``.venv/bin/python benchmarks/memory.py`` (a benchmark, not a test: it prints, it never fails on a
number). For each model family, several sub-model specs and batch sizes (and a few depth-wise block-training
rows), it prints the estimate of ``models.memory``, the peak measured the way the edge agent measures it, and
their ratio; the last line is ``worst ratio: X`` (the ratio farthest from 1).

The measurement (:func:`measure_training_peak`) runs in a fresh child process per row, forked from the same warm
forkserver the edge agent's training children come from (``edge_agent.child.process_context``: torch imported
and initialised by one tiny training step): it sets up its heap as the agent's child does (``--allocator``,
default ``compact``, see ``edge_agent.allocator``), creates the local data (N x C x H x W float32 and labels) and the sub-model's weights as numpy arrays
(as they arrive in a task), collects garbage and takes the baseline RSS; then it builds the model, loads the
weights, creates ``torch.optim.SGD(lr, momentum=0.9, weight_decay=5e-4)`` and runs a few training steps on random
batches (``--steps``, default 20; forward in train mode, cross-entropy, backward, ``clip_grad_norm_(1.0)``,
step, ``zero_grad(set_to_none=True)``). Measured = the RSS high-water mark (reset at the baseline through
``/proc/self/clear_refs``, as the agent's child does) minus the baseline. With CUDA available it
also prints CUDA rows, measured as ``torch.cuda.max_memory_allocated()`` during training.

With ``--allocator default`` (glibc's default heap) measured peaks on CPU vary between runs of one configuration
by up to about 10% (heap fragmentation depends on the address-space layout; see ``models/memory.py``); with
``compact`` they repeat to within about 1 MB. The table also shows the milliseconds per training step.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1e6
SAMPLES = 2000


def measure_training_peak(
    family_name: str,
    family_options: dict[str, Any],
    num_classes: int,
    in_channels: int,
    image_size: tuple[int, int],
    spec: Any,
    batch_size: int,
    momentum: float,
    torch_threads: int,
    *,
    block: int | None = None,
    device: str = "cpu",
    steps: int = 20,
    samples: int = SAMPLES,
    allocator: str = "compact",
) -> tuple[int, float]:
    """Peak training memory above the baseline in bytes, and seconds per step, measured in THIS process (run it
    in a fresh child, whose heap it sets up for ``allocator`` on CPU).

    ``spec`` is a ``SubmodelSpec`` or its ``to_dict()`` form; ``block`` trains only that body block and the head
    (``models.memory.BlockTrainingModel``). On ``device="cuda"`` the result is the peak of
    ``torch.cuda.max_memory_allocated()`` during training above what was allocated before it.
    """
    import numpy as np
    import torch

    from edge_agent import allocator as heap
    from edge_agent.child import peak_rss_bytes, reset_peak_rss, rss_bytes
    from models import SubmodelSpec, block_training_model, get_family

    torch.set_num_threads(torch_threads)
    if device != "cuda":
        heap.configure(allocator)
    family = get_family(family_name, num_classes, in_channels, **family_options)
    if not isinstance(spec, SubmodelSpec):
        spec = SubmodelSpec.from_dict(spec)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, in_channels, *image_size, generator=generator)
    y = torch.randint(0, num_classes, (samples,), generator=generator)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family.build(spec, track_bn_stats=False).state_dict().items()}
    rng = np.random.default_rng(0)
    weights: dict[str, np.ndarray] = {}
    for key, shape in shapes.items():
        array = rng.standard_normal(shape, dtype=np.float32)
        array *= 0.05
        if array.ndim == 1 and key.endswith("weight"):  # batch-norm scales
            array += 1.0
        weights[key] = array
    cuda = device == "cuda"
    if cuda:
        torch.zeros(1, device="cuda")  # create the CUDA context before the baseline
        torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()

    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    model.to(device)
    net: torch.nn.Module = model if block is None else block_training_model(family, model, block, image_size)
    net.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=momentum, weight_decay=5e-4)
    started = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, samples, (batch_size,), generator=generator)
        inputs, targets = x[idx].to(device), y[idx].to(device)
        loss = torch.nn.functional.cross_entropy(net(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    if cuda:
        return int(torch.cuda.max_memory_allocated() - baseline), seconds
    return peak_rss_bytes() - baseline, seconds


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


def _measure_in_child(row: Row, device: str, steps: int, threads: int, allocator: str) -> tuple[int, float]:
    from edge_agent.child import process_context
    from models import SubmodelSpec

    options: dict[str, Any] = {}
    args = (
        row.family,
        options,
        10,
        row.in_channels,
        row.image_size,
        SubmodelSpec.uniform(row.width).to_dict(),
        row.batch_size,
        0.9,
        threads,
    )
    kwargs: dict[str, Any] = {"block": row.block, "device": device, "steps": steps, "allocator": allocator}
    with process_context().Pool(1) as pool:  # forked from the agent's warm training forkserver
        peak, seconds = pool.apply(measure_training_peak, args, kwargs)
    return int(peak), float(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per measurement (default 20)")
    parser.add_argument("--allocator", choices=("compact", "default"), default="compact",
                        help="heap of the measuring child on CPU, as the agent's allocator setting (default compact)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in the measuring child (default 1)"
    )
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
    for device in devices:
        for row in rows():
            family = get_family(row.family, 10, row.in_channels)
            spec = SubmodelSpec.uniform(row.width)
            if row.block is None:
                estimate = family.training_memory_bytes(
                    spec, batch_size=row.batch_size, input_size=row.image_size, device=device, allocator=allocator
                )
            else:
                estimate = family.block_training_memory_bytes(
                    spec,
                    row.block,
                    batch_size=row.batch_size,
                    input_size=row.image_size,
                    device=device,
                    allocator=allocator,
                )
            measured, seconds = _measure_in_child(row, device, args.steps, args.threads, allocator)
            ratio = estimate / measured
            if abs(ratio - 1) > abs(worst - 1):
                worst = ratio
            described = spec.describe() + ("" if row.block is None else f" block={row.block}")
            print(
                f"{device:6s} {row.family:12s} {described:22s} {row.batch_size:5d} {estimate / MB:12.1f} "
                f"{measured / MB:12.1f} {ratio:6.3f} {seconds * 1000:8.0f}",
                flush=True,
            )
    print(f"({len(rows()) * len(devices)} rows, allocator {allocator}, {args.steps} steps each, "
          f"{time.monotonic() - started:.0f} s)")
    print(f"worst ratio: {worst:.3f}")


if __name__ == "__main__":
    main()
