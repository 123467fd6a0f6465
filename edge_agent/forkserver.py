"""The agent's training forkserver and the children it forks: where torch lives.

The agent process itself imports no torch (MQTT, msgpack and numpy only: tens of MB instead of hundreds). A
multiprocessing *forkserver* imports torch, the models, the estimator and the trainer once (``PRELOAD``) and runs
one tiny training step, so every child it forks starts warm: the decision child (``edge_agent.decision``: checks,
estimates, adaptation) and the training child (``edge_agent.child``); where there is no GPU it leaves torch's
optional GPU packages out, and it gives back the library pages it only read (``edge_agent.child_warmup``). It starts
when the first child is asked for, or at once with :func:`start` (the agent's ``forkserver: start-up``), with the
page pool (``edge_agent.page_pool``) preloaded when a pooled runner asked for it first (:func:`preload_page_pool`):
idle until a training child enables it.

A child gets its work directory (``edge_agent.workdir``) and nothing else: its target is a :class:`ChildEntry`, a
module and function named rather than imported, so this module (and the agent) never imports the code the child runs
and torch with it. The entries the agent runs are :data:`TRAIN`, :data:`DECIDE` and :data:`PROBE_CUDA`.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.lifeline import die_with_parent
from edge_agent import gpu_stack, page_pool
from edge_agent.workdir import DECISION_FILE, ERROR_FILE, UPDATE_FILE, Decision, read_progress

#: Modules the forkserver imports before forking anything (the one prepares it: ``edge_agent.child_warmup``).
PRELOAD = ["edge_agent.forkserver_preload"]
#: How far the measured CPU peak of identical tasks moves between runs (the smallest ``benchmarks/memory.py``
#: rows: about 0.3 MB between invocations; two agents of one simulation training the same sub-MB task: 0.37 and
#: 0.73 MB); the calibration does not learn from tasks that are small against it.
CPU_PEAK_RESOLUTION_BYTES = 300_000
#: How often a waiting caller looks at its ``cancel`` event (seconds).
CANCEL_POLL_S = 0.1
#: How often a waiting caller looks at a training child's progress (seconds).
PROGRESS_POLL_S = 1.0


@dataclass(frozen=True)
class ChildEntry:
    """What a forkserver child runs: ``module.function(workdir)``, imported in the child (the forkserver preloaded
    it), named here so that the agent's own process never imports it."""

    module: str
    function: str

    def __str__(self) -> str:
        return f"{self.module}:{self.function}"

    def resolve(self) -> Callable[[Path], Any]:
        """The function itself (imports its module: torch, for the agent's entries)."""
        function = getattr(importlib.import_module(self.module), self.function)
        if not callable(function):
            raise TypeError(f"{self} is not callable")
        return function  # type: ignore[no-any-return]


#: The training child: trains the task of its work directory and writes the update (``edge_agent.child``).
TRAIN = ChildEntry("edge_agent.child", "train_in_workdir")
#: The decision child: checks, estimates and adapts the task before training (``edge_agent.decision``).
DECIDE = ChildEntry("edge_agent.decision", "decide_in_workdir")
#: Whether torch sees a CUDA device, written as ``cuda.json`` (``edge_agent.child``).
PROBE_CUDA = ChildEntry("edge_agent.child", "probe_cuda")

_context: Any = None
#: The page pool to preload into the forkserver when it starts (:func:`preload_page_pool`), None for none.
_page_pool: Path | None = None
#: The training devices the agents of this process declared (:func:`declare_device`); all "cpu": the server leaves
#: torch's GPU packages out even where a GPU is present.
_devices: set[str] = set()
#: The torch threads the agents of this process train with (:func:`declare_threads`).
_threads: set[int] = set()
#: OpenMP's variable: the default size of its teams, read when a library's OpenMP runtime loads.
OMP_THREADS_ENV = "OMP_NUM_THREADS"
#: Held while this process starts a child or reads one's exit status (see :func:`_exit_code`).
_STATUS_LOCK = threading.Lock()


def process_context() -> Any:
    """The forkserver context (preloading torch and the trainer), or spawn where fork is unavailable."""
    global _context
    if _context is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            forkserver = multiprocessing.get_context("forkserver")
            forkserver.set_forkserver_preload(PRELOAD)
            _context = forkserver
        else:
            _context = multiprocessing.get_context("spawn")
    return _context


def preload_page_pool() -> bool:
    """Have the forkserver started with the page pool preloaded (a runner whose heap is ``pooled`` asks, before
    its first child; a server already running keeps what it has). False where the pool is not usable here."""
    global _page_pool
    if not page_pool.usable():
        return False
    _page_pool = page_pool.library_path()
    return _page_pool is not None


def declare_device(device: str) -> None:
    """Say which device an agent of this process trains on ("cpu", "cuda" or "auto"), before the forkserver starts:
    when every one says "cpu", the server keeps torch's GPU packages out (``edge_agent.gpu_stack``) even on a
    machine with a GPU. A server already running keeps what it has."""
    _devices.add(device)


def declare_threads(count: int) -> None:
    """Say how many torch threads an agent of this process trains with, before the forkserver starts. The server
    starts with the most any agent declared as its OpenMP default (:data:`OMP_THREADS_ENV`; one the environment
    sets is kept): the libraries that size their pools from that default when they load, not from
    ``torch.set_num_threads`` (OpenBLAS; the Arm Compute Library's scheduler, under oneDNN's convolutions on arm64
    cores without SVE), then run every child's work on that many threads. The server runs torch on one thread and
    its warm-up starts no OpenMP team a child could wait on (``edge_agent.child_warmup``). A server already running
    keeps what it has."""
    if count < 1:
        raise ValueError(f"a training child needs at least one thread, got {count}")
    _threads.add(count)


def declare(device: str, threads: int, *, page_pool: bool = False) -> None:
    """What one agent of this process tells the forkserver before it starts: its training device
    (:func:`declare_device`), its torch threads (:func:`declare_threads`) and, with ``page_pool``, that its heap is
    pooled (:func:`preload_page_pool`)."""
    if page_pool:
        preload_page_pool()
    declare_device(device)
    declare_threads(threads)


def start() -> None:
    """Start the forkserver now (it imports torch and warms up) instead of at the first child."""
    with _STATUS_LOCK:
        _ensure_running()


def _ensure_running() -> None:
    """Start the forkserver unless it runs, with the page pool in its ``LD_PRELOAD`` when one was asked for,
    :data:`gpu_stack.CPU_ONLY_ENV` when every agent here trains on the CPU and the declared threads as its OpenMP
    default (:func:`declare_threads`) (call with :data:`_STATUS_LOCK` held).
    The server is started with this process's environment, so the variables are set only while it starts; a
    process another thread starts meanwhile gets them too, which changes little there (the pool does nothing
    until something enables it; the second is read by the forkserver's preload only; the third sizes OpenMP's
    default, which torch's own ``set_num_threads`` overrides)."""
    if process_context().get_start_method() != "forkserver":
        return
    starting: dict[str, str] = {}
    if _page_pool is not None and not os.environ.get("LD_PRELOAD"):
        starting["LD_PRELOAD"] = str(_page_pool)
    if _devices == {"cpu"}:
        starting[gpu_stack.CPU_ONLY_ENV] = "1"
    if _threads and not os.environ.get(OMP_THREADS_ENV):
        starting[OMP_THREADS_ENV] = str(max(_threads))
    before = {name: os.environ.get(name) for name in starting}
    os.environ.update(starting)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _enter(entry: ChildEntry, workdir: str, hide_gpus: bool = False) -> None:
    """A child's target: ``entry`` run on ``Path(workdir)``, imported in the child (preloaded by the forkserver),
    with every GPU hidden from CUDA first when ``hide_gpus`` (a child that trains or estimates on the CPU: before
    anything in it counts GPUs, as autograd's first pass would; ``edge_agent.gpu_stack.hide_gpus``).

    Whatever it raises is written to the work directory's ``error.txt`` (the first line says what) and the child
    exits 1; otherwise it exits 0, without running the server's inherited exit handlers. It ends with the agent's
    process, however that ends (:func:`_end_with_the_agent`)."""
    try:
        _end_with_the_agent()
        if hide_gpus:
            gpu_stack.hide_gpus()
        entry.resolve()(Path(workdir))
    except BaseException as exc:  # noqa: BLE001 - everything becomes a reported failure
        (Path(workdir) / ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _end_with_the_agent() -> None:
    """In a forkserver child: be killed when the agent's process ends, a SIGKILL included.

    Python's forkserver exits when the read end of its "alive" pipe sees EOF, but every child holds a write end
    of that pipe as well as the agent: a child of a SIGKILLed agent trained on to the end of its task, and kept
    the server (and its resource tracker) alive until then. Here the child asks the kernel for SIGKILL when the
    server ends (``common.lifeline``; the server is single-threaded, and it cannot end before this call, since the
    child still holds its write end), then drops its write end: the server then ends with the agent, and takes
    its children with it. (A spawned child, where there is no forkserver, has nothing to drop and is left as it
    is: its parent would be one of the agent's threads.)"""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if not isinstance(alive, int) or not die_with_parent(signal.SIGKILL):
        return
    os.close(alive)
    server._forkserver_alive_fd = None  # type: ignore[union-attr]


@dataclass(frozen=True)
class Exit:
    """How a child ended: its exit code (negative: the signal), and whether it was stopped for its time limit,
    because its caller cancelled it, or because it made no progress for its caller's ``stall_timeout``."""

    exitcode: int | None
    timed_out: bool = False
    cancelled: bool = False
    stalled: bool = False

    @property
    def killed_by(self) -> str | None:
        """The signal's name when the child was killed by one."""
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None


class TorchUnavailable(RuntimeError):
    """The forkserver could not start, or a child of it could not answer a question about torch (torch missing
    or broken, say)."""


def run_child(entry: ChildEntry, workdir: Path, timeout: float, on_start: Callable[[int], None] | None = None,
              cancel: threading.Event | None = None, stall_timeout: float | None = None,
              hide_gpus: bool = False) -> Exit:
    """Run ``entry`` on ``workdir`` in a forkserver child; kill it after ``timeout`` s,
    as soon as ``cancel`` is set (checked every :data:`CANCEL_POLL_S`), or, with ``stall_timeout``, once the
    progress it writes into ``workdir`` (:class:`~edge_agent.workdir.ProgressBeacon`) has not moved for that many
    seconds since its start or its last beat (checked every :data:`PROGRESS_POLL_S`): a child deadlocked in a
    kernel is noticed, not waited for until the deadline. ``hide_gpus``: the child sees no GPU (see
    :func:`_enter`). Safe to call from several threads."""
    process = process_context().Process(target=_enter, args=(entry, str(workdir), hide_gpus),
                                        daemon=True)
    try:
        # start() polls the other children (multiprocessing's clean-up of finished ones). The first start also
        # waits for the forkserver to import torch; other threads' status reads wait that long (seconds, once).
        with _STATUS_LOCK:
            _ensure_running()
            process.start()
    except (EOFError, ConnectionError):  # the server died importing PRELOAD (a broken torch, say)
        # (EOFError while it dies, ConnectionRefusedError once it is gone: which one is a matter of timing.)
        raise TorchUnavailable("the training forkserver could not start; it imports torch and the trainer, and "
                               "its error is on this process's stderr") from None
    except OSError as exc:  # it was never started: its socket's path too long for AF_UNIX (a long TMPDIR), say
        raise TorchUnavailable(f"the training forkserver could not be started: {exc} (its socket goes in a new "
                               f"directory under {tempfile.gettempdir()})") from None
    if on_start is not None:
        on_start(process.pid)
    now = time.monotonic()
    deadline = now + timeout
    progress, moved = read_progress(workdir), now
    poll = min(CANCEL_POLL_S if cancel is not None else math.inf,
               PROGRESS_POLL_S if stall_timeout is not None else math.inf)
    while (code := _exit_code(process)) is None:
        now = time.monotonic()
        remaining = deadline - now
        cancelled = cancel is not None and cancel.is_set()
        stalled = False
        if stall_timeout is not None:
            seen = read_progress(workdir)
            if seen != progress:
                progress, moved = seen, now
            stalled = now - moved >= stall_timeout
        if cancelled or remaining <= 0 or stalled:
            process.kill()
            multiprocessing.connection.wait([process.sentinel], 10)
            return Exit(_exit_code(process), timed_out=not cancelled and not stalled, cancelled=cancelled,
                        stalled=stalled and not cancelled)
        # Waits until the child ends without reading its status (that is _exit_code's, under the lock).
        multiprocessing.connection.wait([process.sentinel], min(remaining, poll))
    return Exit(code)


def _exit_code(process: Any) -> int | None:
    """The child's exit code, None while it runs. A forkserver child's status is 8 bytes the server writes once
    into a pipe; two threads polling at once (one in ``start()``'s clean-up of finished children, one waiting for
    its own) could both see the pipe readable, and the one that found it empty set the exit code to 255: a
    decision child that succeeded was reported failed (seen with two training processes at once in a
    simulation). Every poll therefore holds :data:`_STATUS_LOCK`."""
    with _STATUS_LOCK:
        return process.exitcode


def error_text(workdir: Path) -> str | None:
    """The last 2,000 characters of what a failed child wrote into ``error.txt``."""
    path = workdir / ERROR_FILE
    return path.read_text(errors="replace")[-2000:] if path.exists() else None


@dataclass(frozen=True)
class ChildOutcome:
    """How a training child ended: the encoded update, or why there is none."""

    update: bytes | None
    exitcode: int | None
    error: str | None
    timed_out: bool = False
    cancelled: bool = False
    stalled: bool = False
    out_of_memory: bool | None = None
    """For a child killed by SIGKILL (not for its deadline): whether the kernel counted an OOM kill meanwhile
    (None: not known; see :mod:`edge_agent.oom`)."""

    @property
    def killed_by(self) -> str | None:
        """The signal's name when the child was killed by one."""
        return Exit(self.exitcode).killed_by


def run_training(workdir: Path, timeout: float, on_start: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None, stall_timeout: float | None = None,
                 device: str = "cpu") -> ChildOutcome:
    """Train the task of ``workdir`` (``edge_agent.child``) on ``device`` in a child and wait at most ``timeout``
    seconds, until ``cancel`` is set, or until it has made no progress for ``stall_timeout`` seconds."""
    end = run_child(TRAIN, workdir, timeout, on_start, cancel, stall_timeout,
                    hide_gpus=device != "cuda")
    if end.cancelled:
        return ChildOutcome(None, end.exitcode, "training was cancelled", cancelled=True)
    if end.stalled:
        beats = read_progress(workdir)
        return ChildOutcome(None, end.exitcode, f"the training process made no progress for {stall_timeout:.0f} s "
                            f"(no training step or stage ended; {beats or 0} signs of progress before) and was "
                            "killed", stalled=True)
    if end.timed_out:
        return ChildOutcome(None, end.exitcode, f"training did not finish within {timeout:.0f} s", timed_out=True)
    update_path = workdir / UPDATE_FILE
    if end.exitcode == 0 and update_path.exists():
        return ChildOutcome(update_path.read_bytes(), 0, None)
    return ChildOutcome(None, end.exitcode, error_text(workdir))


class DecisionFailed(Exception):
    """The decision child died, overran or answered nothing readable; the message says which."""


def run_decision(workdir: Path, timeout: float, on_start: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None) -> Decision:
    """Decide what to train for the task of ``workdir`` (``edge_agent.decision``) in a child (killed when
    ``cancel`` is set)."""
    # Estimates run on the meta device: CUDA need not start there (autograd's pass would start it).
    end = run_child(DECIDE, workdir, timeout, on_start, cancel, hide_gpus=True)
    if end.cancelled:
        raise DecisionFailed("deciding what to train was cancelled")
    if end.timed_out:
        raise DecisionFailed(f"deciding what to train did not finish within {timeout:.0f} s")
    if end.exitcode != 0 or not (workdir / DECISION_FILE).exists():
        why = f"killed by {end.killed_by}" if end.killed_by else f"exit code {end.exitcode}"
        detail = (error_text(workdir) or "").strip().splitlines()[:1]
        raise DecisionFailed(f"the deciding process failed ({why})" + (f": {detail[0]}" if detail else ""))
    try:
        return Decision.read(workdir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DecisionFailed(f"the deciding process answered garbage: {exc}") from None


def cuda_available(timeout: float = 120.0) -> bool:
    """Whether torch sees a CUDA device, asked in a forkserver child (which starts the forkserver); raises
    :class:`TorchUnavailable` with the child's error when it cannot say."""
    with tempfile.TemporaryDirectory(prefix="fedfit-cuda-") as workdir:
        try:
            end = run_child(PROBE_CUDA, Path(workdir), timeout)
        except TorchUnavailable as exc:
            raise TorchUnavailable(f"device: auto could not ask torch whether CUDA is available: {exc}") from None
        answer = Path(workdir) / "cuda.json"
        if end.exitcode != 0 or not answer.exists():
            detail = (error_text(Path(workdir)) or f"exit code {end.exitcode}").strip().splitlines()[0]
            raise TorchUnavailable(f"device: auto could not ask torch whether CUDA is available: {detail}")
        return bool(json.loads(answer.read_text())["available"])
