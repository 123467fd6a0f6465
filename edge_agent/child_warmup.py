"""How the training forkserver prepares itself before it forks anything (:func:`prepare`, run as it imports
``edge_agent.forkserver_preload``), so that every child starts warm and the idle server holds little.

1. Where no GPU is wanted (none is present, or every agent of the starting process trains on the CPU:
   ``edge_agent.gpu_stack``), every GPU is hidden from CUDA in the server and its children, and torch's optional
   GPU packages are kept out before torch is imported: ``triton`` (which ``torch._dynamo`` would import: about
   75 MB) and ``cuda.bindings`` (about 10 MB). The CUDA libraries of torch's CUDA build are linked into libtorch
   and load with it whatever the device. CUDA is initialised by nothing here: where a GPU is wanted, a child
   that trains on ``cuda`` initialises it itself (a CUDA initialised before the fork is unusable in the child),
   and a child that trains on the CPU hides the GPUs first (``edge_agent.child``).
2. torch, the children's modules (:data:`CHILD_MODULES`: the trainer, the estimator, the models) and
   ``torch._dynamo``, the lazy import behind the first ``torch.optim`` optimizer (sympy and about 890 modules,
   70 MB), are imported once here instead of in every child's measured peak.
3. One tiny training step (:func:`warm_up`), so that the torch runtime's one-time initialisation (kernel
   dispatch tables, allocator arenas) happens once in the server and every forked training child starts warm
   instead of paying it again inside its measured peak. It runs on one thread and starts no thread pool a child
   would inherit without its threads: on aarch64 its convolution runs without oneDNN (:func:`no_arm_compute_pool`),
   so each child starts the Arm Compute Library's team itself, of the server's OpenMP default: the agent's
   ``torch_threads`` (``edge_agent.forkserver.declare_threads``). Where torch's BLAS
   would crash the core on several threads, it runs on one (``common.blas_threads``). Where a GPU is wanted the
   step leaves its backward pass out: autograd's first pass would initialise CUDA here and make torch refuse
   autograd in every child (:func:`warm_up`).
4. Every object the server holds is frozen out of the garbage collector (``gc.freeze``), so that a collection in
   a child does not write to their pages and copy them into the child's memory while it trains (measured: +0.25
   to 0.4 MB on the smallest ``benchmarks/memory.py`` rows, 0.9 to 2.4 MB); the heap gives back what the
   imports and the step freed (``malloc_trim``).
5. The pages of code and constants the imports and the step read (libtorch, the CUDA libraries, numpy, ...) are
   unmapped from the server (``edge_agent.mappings``): a forked child never inherits those page-table entries
   (it maps what it runs itself, from the page cache, and warms up before its baseline:
   ``edge_agent.child.warm_up_training``), so they only added to the idle server's RSS (measured: 235 MB with
   torch's CUDA build, 95 MB with its CPU build), as pages the kernel could reclaim.

``benchmarks/forkserver_anatomy.py`` (part of ``benchmarks/footprint.py``) measures each step (``on_step``) and
compares with the server as it was before steps 1, 5 and the trim (``light=False``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import platform
from collections.abc import Callable, Iterator

from common.blas_threads import guard_blas_threads
from edge_agent import allocator, gpu_stack, mappings

#: The modules forked children run, imported by the server.
CHILD_MODULES = ("edge_agent.child", "edge_agent.decision")


@contextlib.contextmanager
def no_arm_compute_pool() -> Iterator[None]:
    """On aarch64, oneDNN switched off for what runs inside (torch's own convolution kernels run instead);
    elsewhere nothing. Use around the server's warm-up.

    On arm64 cores without SVE (a Raspberry Pi 4's Cortex-A72, a Pi 5's A76) oneDNN runs convolutions through the
    Arm Compute Library, whose OpenMP scheduler sizes its team from OpenMP's default (``OMP_NUM_THREADS``, else
    the cores) as the library loads, not from ``torch.set_num_threads``: a warm-up convolution through it left a
    GNU OpenMP worker in the server (3 -> 4 threads), and a forked child's first parallel convolution waited for
    that worker forever at the pool's barrier (native backtrace: ``arm_compute::OMPScheduler::run_workloads`` ->
    libgomp futex; emulated, ``benchmarks/arm64/fork_hang.py --warmup conv``: hung with torch 2.9.1 and 2.14.1).
    Kept out of the server, the team is started in each child, after the fork, at its first convolution, of the
    server's OpenMP default: the agent's ``torch_threads`` (``edge_agent.forkserver.declare_threads``; emulated,
    50 children forked without a hang, ``benchmarks/arm64/forkserver_threads.py``). On exit oneDNN is as it was:
    on, for the children."""
    if platform.machine() not in ("aarch64", "arm64"):
        yield
        return
    import torch

    # (The module's own setter; its flags() context would also set TF32 options and warn that there is no XPU.)
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def warm_up(*, autograd: bool = True) -> None:
    """Forward, backward and an SGD step of a small conv net on CPU, with one thread.

    ``autograd=False`` leaves the backward pass out (the gradients are set to zeros instead) where a GPU is
    wanted: autograd's first pass counts the GPUs, which initialises CUDA in this process (no child forked
    afterwards could use it) and, with a GPU there, starts autograd's device threads and a fork handler after
    which torch refuses autograd in every forked child (``edge_agent.gpu_stack.hide_gpus``). Each training child
    then runs its first backward pass in its own warm-up, before its baseline."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                          nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    with no_arm_compute_pool():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
        if autograd:
            loss.backward()
        else:
            del loss
            for parameter in model.parameters():
                parameter.grad = torch.zeros_like(parameter)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def prepare(on_step: Callable[[str], None] | None = None, *, light: bool = True) -> None:
    """Prepare this process as the training forkserver (the steps above); ``on_step(name)`` is called after each.
    ``light=False`` leaves out what a device without a GPU need not hold (steps 1 and 5, the trim): the server
    as it was, for comparison."""
    def done(name: str) -> None:
        if on_step is not None:
            on_step(name)

    gpu = gpu_stack.gpu_wanted()
    if not gpu:
        gpu_stack.hide_gpus()  # its children train on the CPU: autograd then counts no GPU, here or there
        if light:
            gpu_stack.keep_out()
            done("GPU packages kept out")
    else:
        gpu_stack.probe_without_cuda()
    importlib.import_module("torch")
    done("import torch")
    if (blas := guard_blas_threads()) is not None:
        done(blas)
    for name in CHILD_MODULES:
        importlib.import_module(name)
    done("FedFit's modules")
    importlib.import_module("torch._dynamo")
    done("torch._dynamo")
    warm_up(autograd=not gpu)
    done("warm-up step" if not gpu else "warm-up step (no backward pass: a GPU is wanted)")
    gc.collect()
    gc.freeze()
    if light:
        allocator.settle("default")
    done("gc.freeze" + (", heap trimmed" if light else ""))
    if light:
        mappings.release_file_pages()
        done("file pages released")
