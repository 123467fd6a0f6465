"""Training-memory estimator against the measured peak (PROTOTYPE)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    block: int | None = None,
    steps: int = 5,
    samples: int = 2000,
) -> int:
    import numpy as np
    import torch

    from models import get_family
    from models.memory import block_training_model

    torch.set_num_threads(torch_threads)
    family = get_family(family_name, num_classes, in_channels, **family_options)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, in_channels, *image_size, generator=gen)
    y = torch.randint(0, num_classes, (samples,), generator=gen)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family.build(spec, track_bn_stats=False).state_dict().items()}
    rng = np.random.default_rng(0)
    weights = {}
    for key, shape in shapes.items():
        arr = rng.standard_normal(shape, dtype=np.float32)
        arr *= 0.05
        if ".bn" in f".{key}" and key.endswith("weight"):
            arr += 1.0
        weights[key] = arr
    gc.collect()
    baseline = _rss_bytes()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    model = family.build(spec, track_bn_stats=False)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    net: torch.nn.Module = model
    if block is not None:
        net = block_training_model(family, model, block, image_size)
    net.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=momentum, weight_decay=5e-4)
    for _ in range(steps):
        idx = torch.randint(0, samples, (batch_size,), generator=gen)
        inputs, targets = x[idx], y[idx]
        loss = torch.nn.functional.cross_entropy(net(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if before > baseline + (peak - baseline) // 100 and before >= peak:
        print(f"warning: pre-baseline high-water mark {before} above peak {peak}", file=sys.stderr)
    return peak - baseline


def _measure_in_child(*args: Any) -> int:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return int(pool.apply(measure_training_peak, args))


if __name__ == "__main__":
    pass
