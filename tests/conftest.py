"""Suite-wide fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache

# The suite runs several workers, each with training children, on the same cores: an OpenMP thread that waits for
# work sleeps instead of spinning (set before torch loads its OpenMP, and inherited by every child and forkserver).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import structlog
import torch

from common.cores import available_cores
from edge_agent import forkserver, gpu_stack

# As in the agent, whose default heap is "pooled": the training forkserver, whichever test starts it, has the page
# pool preloaded (where it can be built), so tests of the pooled heap do not depend on the order they run in.
forkserver.preload_page_pool()
# The test process hosts agents of every device: its forkserver, whichever test starts it, is the one a process
# with a CUDA agent gets (on a machine with a GPU: no CUDA and no backward pass in the server, the CPU children
# hide the GPUs themselves), not one that hides the GPUs from every child because a CPU agent happened to start it.
forkserver.declare_device("auto")
# ... and its OpenMP default is every core, as an agent's with the default torch_threads, not whatever count the
# agents the tests happened to build before it started declared.
forkserver.declare_threads(available_cores())


@pytest.fixture(autouse=True)
def fresh_logging() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults (the CLI configures it to captured streams)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the tests' training children and the other test processes then
    do not fight for the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def gpu_settings_restored() -> Iterator[None]:
    """A child's entry run in the test process (a decision, say) hides the GPUs from its process as a child does
    (``edge_agent.gpu_stack``); the variables are put back so that later tests, and the forkserver they may
    start, see the machine's GPUs."""
    names = (gpu_stack.VISIBLE_DEVICES_ENV, gpu_stack.NVML_CHECK_ENV)
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@cache
def cuda_usable() -> bool:
    """Whether torch can train on a GPU here, asked in a process of its own (CUDA is never started in the test
    process, whose children must be free to start it); False at once where no GPU driver is present."""
    if not gpu_stack.gpu_present():
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300, check=False).returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where torch can train on a GPU (``benchmarks/gpu_check.py`` checks the rest)."""
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if gpu_tests and not cuda_usable():
        skip = pytest.mark.skip(reason="needs a GPU torch can train on")
        for item in gpu_tests:
            item.add_marker(skip)


def process_ended(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (any process, not only a child of this one) ends within ``timeout`` seconds: waits on
    its pidfd, which becomes readable when it exits (a zombie has exited)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.fixture
def wait_ended() -> Callable[[int, float], bool]:
    """:func:`process_ended`, for tests of processes that must end with the one that started them."""
    return process_ended
