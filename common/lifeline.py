"""Child processes that end with the process that started them, however it ends (a SIGKILL included).

Linux's ``prctl(PR_SET_PDEATHSIG, sig)`` has the kernel send ``sig`` to a process when its parent ends. Two
catches, both handled here:

- The "parent" is the *thread* that forked the child: a child started from a short-lived thread is signalled when
  that thread ends, with the process alive. :func:`spawn_tied` therefore forks every child from one daemon thread
  of this module that never returns: it ends with the process (not before, as a thread joined at interpreter exit
  would, while other threads may still use the child).
- The parent may end between the fork and the ``prctl``: the child then checks that its parent is still the
  process that forked it, and exits at once if not.

``spawn_tied`` sets the signal in ``preexec_fn``, which Python documents as unsafe in a process with threads (the
child runs Python code between fork and exec, and a lock another thread held at the fork stays held in it). What
runs there of this module is one call of a C function resolved beforehand and one ``getppid``: no import, no
logging, no lock (CPython's own after-fork hooks run first, as in any fork: they re-initialise the locks they own).
It forks rather than vforks, so a broker started from a large process copies its page tables (a moment, and no
memory until written). Elsewhere than Linux (no ``prctl``) children are started as usual, untied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

__all__ = ["die_with_parent", "spawn_tied", "supported"]

#: ``PR_SET_PDEATHSIG`` of <linux/prctl.h>.
_PR_SET_PDEATHSIG = 1
#: Seconds a child may take to start (fork and exec) before the caller is told it did not.
_SPAWN_TIMEOUT_S = 60.0


def _load_prctl() -> Any:
    """libc's ``prctl``, resolved once (never in a child between fork and exec); None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    for name in (ctypes.util.find_library("c"), None):  # None: the process's own symbols (musl has no libc.so.6)
        try:
            prctl = ctypes.CDLL(name, use_errno=True).prctl
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()
#: Work for the spawning thread: (what to run, where its outcome goes).
_Job = tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
_jobs: queue.SimpleQueue[_Job] | None = None
_spawner_pid = 0  # the process whose thread serves _jobs (a forked copy of this module has none)
_spawner_lock = threading.Lock()


def supported() -> bool:
    """Whether children can be tied to their parent here (Linux)."""
    return _prctl is not None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to the calling process when the thread that forked it ends. With ``parent``
    (the pid of the process that forked it), exit at once when that one has gone already. False where it cannot
    be done (not Linux, or the call failed)."""
    if _prctl is None or _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent ended before the signal was set: nothing will send it now
    return True


def _tie(sig: int, parent: int) -> None:
    """``preexec_fn`` of :func:`spawn_tied` (in the child, before exec)."""
    die_with_parent(sig, parent)


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    """The spawning thread: runs each job, for ever."""
    while True:
        start, outcome = jobs.get()
        try:
            outcome.set_result(start())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            outcome.set_exception(exc)


def _spawner() -> queue.SimpleQueue[_Job]:
    """The queue of the one thread children are forked from, started at the first call (again in a forked copy of
    this process, which has no thread of its parent's)."""
    global _jobs, _spawner_pid
    with _spawner_lock:
        if _jobs is None or _spawner_pid != os.getpid():
            _jobs = queue.SimpleQueue()
            _spawner_pid = os.getpid()
            threading.Thread(target=_serve, args=(_jobs,), name="fedfit-lifeline", daemon=True).start()
        return _jobs


def spawn_tied(args: Sequence[str], sig: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **popen)``, the child sent ``sig`` when this process ends (see the module's
    docstring); where that is not supported, a plain ``Popen``. Raises what ``Popen`` raises."""
    if _prctl is None:
        return subprocess.Popen(args, **popen)
    tie = partial(_tie, sig, os.getpid())

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(args, preexec_fn=tie, **popen)  # noqa: PLW1509 - see the module docstring

    outcome: Future[subprocess.Popen[bytes]] = Future()
    _spawner().put((start, outcome))
    try:
        return outcome.result(timeout=_SPAWN_TIMEOUT_S)
    except TimeoutError:
        raise OSError(f"{args[0]} did not start within {_SPAWN_TIMEOUT_S:g} s") from None
