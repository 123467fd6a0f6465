"""Suite-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def fresh_logging() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults (the CLI configures it to captured streams)."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
