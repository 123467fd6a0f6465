"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
import torch

from edge_agent import forkserver

# As in the agent, whose default heap is "pooled": the training forkserver, whichever test starts it, has the page
# pool preloaded (where it can be built), so tests of the pooled heap do not depend on the order they run in.
forkserver.preload_page_pool()


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
