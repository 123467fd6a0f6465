"""common.lifeline: a child started with spawn_tied outlives the thread that asked for it, and ends with the process
that started it, a SIGKILL included."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from common import lifeline

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not lifeline.supported(), reason="PR_SET_PDEATHSIG is Linux's")


def test_a_tied_child_outlives_the_thread_that_started_it() -> None:
    started: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: started.append(lifeline.spawn_tied(["sleep", "600"])))
    thread.start()
    thread.join()  # the asking thread has ended: the child was forked by lifeline's own thread
    [child] = started
    try:  # (the asking thread's end, were the child tied to it, signals it a moment after join(): wait a second)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(1.0)
    finally:
        child.kill()
        child.wait()


def test_a_tied_child_ends_with_its_parent_killed(wait_ended: Callable[[int, float], bool]) -> None:
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, threading
        from common.lifeline import spawn_tied
        child = spawn_tied(["sleep", "600"])
        print(child.pid, flush=True)
        threading.Event().wait()
    """)], cwd=ROOT, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert not wait_ended(child, 0)  # alive while its parent is
    parent.kill()
    parent.wait()
    assert wait_ended(child, 30)


def test_a_child_whose_parent_is_gone_already_exits() -> None:
    """The parent may end between the fork and the prctl: a child that finds another parent exits at once."""
    code = "import os\nfrom common.lifeline import die_with_parent\ndie_with_parent(parent=os.getppid() + 1)\nprint(1)"
    said = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert (said.returncode, said.stdout) == (1, "")
