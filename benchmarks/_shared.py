"""What the benchmarks share: the ``fedfit`` command as this interpreter runs it, and a wait for a condition.

Importing it also puts the repository's root on ``sys.path``, so that a benchmark run as a script
(``.venv/bin/python benchmarks/NAME.py``) can import the load-test rig, ``loadrig``: it lives at the root of a
checkout and is not installed with FedFit.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def fedfit(*args: str) -> list[str]:
    """The command line of ``fedfit ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "fedfit.cli", *args]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               alive: Callable[[], str | None] = lambda: None) -> None:
    """Poll ``predicate`` every 0.2 s; TimeoutError after ``timeout`` s, RuntimeError when ``alive`` says why not."""
    deadline = time.monotonic() + timeout
    while not predicate():
        problem = alive()
        if problem is not None:
            raise RuntimeError(f"{what}: {problem}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.2)
