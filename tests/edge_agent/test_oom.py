"""Telling the OOM killer's SIGKILL from any other: the counters read (prepared files), and a real OOM kill of a
training child inside a memory cgroup where this machine lets the test make one."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_agent.memory import CGROUP_ROOT, own_cgroup_dir
from edge_agent.oom import OomCount, oom_kills, struck
from models import SubmodelSpec

EVENTS = "low 0\nhigh 0\nmax 3\noom 2\noom_kill {kills}\noom_group_kill 0\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_cgroups_memory_events_count_first(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    events = write(cgroup / "memory.events", EVENTS.format(kills=4))
    vmstat = write(tmp_path / "vmstat", "pgfault 10\noom_kill 9\n")
    assert oom_kills(cgroup, vmstat) == OomCount(str(events), 4)


def test_without_a_memory_controller_the_kernels_account_counts(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()  # cgroup v2 without the memory controller: no memory.events
    vmstat = write(tmp_path / "vmstat", "pgfault 10\noom_kill 9\nnr_free_pages 3\n")
    assert oom_kills(cgroup, vmstat) == OomCount(str(vmstat), 9)


@pytest.mark.parametrize("vmstat_text", [None, "pgfault 10\n", "oom_kill many\n"], ids=["absent", "no key", "garbled"])
def test_no_readable_counter_is_none(tmp_path: Path, vmstat_text: str | None) -> None:
    vmstat = tmp_path / "vmstat"
    if vmstat_text is not None:
        vmstat.write_text(vmstat_text)
    assert oom_kills(tmp_path / "no-cgroup", vmstat) is None


def test_struck_compares_readings_of_one_counter() -> None:
    a, b = OomCount("events", 2), OomCount("events", 3)
    assert struck(a, b) is True
    assert struck(a, a) is False
    assert struck(None, b) is None and struck(a, None) is None
    assert struck(a, OomCount("vmstat", 5)) is None  # two different counters tell nothing


def test_this_machine_has_a_counter() -> None:
    assert oom_kills() is not None  # Linux 4.13+: at least /proc/vmstat's oom_kill


# ------------------------------------------------------------------------------------------------- runner
U = SubmodelSpec.uniform
LONG = 400  # epochs: long enough to be killed mid-training


def counter(*values: int | None) -> Callable[[], OomCount | None]:
    """A counter that reads ``values`` in turn (the last one from then on)."""
    readings = list(values)

    def read() -> OomCount | None:
        value = readings.pop(0) if len(readings) > 1 else readings[0]
        return None if value is None else OomCount("test", value)

    return read


def killed_run(runner, make_task, kill_when_busy):
    def watch() -> None:
        deadline = time.monotonic() + 60
        while runner.child_pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if runner.child_pid is not None:
            kill_when_busy(runner.child_pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    update = runner.run(make_task(U(1.0), epochs=LONG))
    watcher.join(10)
    return update


def test_a_sigkill_counted_as_an_oom_kill_teaches_the_calibration(make_task, make_runner, kill_when_busy):
    runner = make_runner(budget=2**30)
    runner.oom_kills = counter(5, 6)  # the kernel counted one OOM kill while the child ran
    update = killed_run(runner, make_task, kill_when_busy)
    assert update.status == "failed"
    assert update.reason.startswith("training process was killed by the kernel's OOM killer (SIGKILL, out of memory)")
    assert runner.calibration.floor > 0  # the real need was above what was available


@pytest.mark.parametrize(("readings", "said"), [
    ((5, 5), "training process was killed by SIGKILL, not for memory (the kernel counted no OOM kill)"),
    ((None,), "training process was killed by SIGKILL (no OOM-kill counter to tell whether for memory)"),
], ids=["no oom kill counted", "no counter"])
def test_any_other_sigkill_fails_the_task_without_touching_the_calibration(make_task, make_runner, kill_when_busy,
                                                                         readings, said):
    runner = make_runner(budget=2**30)
    runner.oom_kills = counter(*readings)
    update = killed_run(runner, make_task, kill_when_busy)
    assert update.status == "failed" and update.reason.startswith(said), update.reason
    assert runner.calibration.floor == 0.0


# --------------------------------------------------------------------------------------- a real OOM kill
JAIL_BATCH = 4096  # samples, all in one step: about 21 MiB mapped afresh per step
JAIL_EPOCHS = 200  # steps of about 0.12 s here: the jail lands long before the end


def _v1_memory_dir() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/")
    return None


@pytest.fixture
def memory_jail() -> Iterator[Callable[[int, int], None]]:
    """``jail(pid, limit_bytes)``: move ``pid`` into a fresh memory cgroup of that limit (cgroup v2 under this
    process's own cgroup, else v1); skips the test where this machine lets it make none."""
    made: list[Path] = []
    name = f"fedfit-oom-{uuid.uuid4().hex[:8]}"
    candidates: list[tuple[Path, str, str]] = []
    own = own_cgroup_dir()
    if own is not None and "memory" in _read(own / "cgroup.subtree_control").split():
        candidates.append((own / name, "memory.max", "cgroup.procs"))
    v1 = _v1_memory_dir()
    if v1 is not None and (v1 / "memory.limit_in_bytes").exists():
        candidates.append((v1 / name, "memory.limit_in_bytes", "tasks"))
    jail_dir = None
    for directory, limit_file, procs_file in candidates:
        try:
            directory.mkdir()
        except OSError:
            continue
        made.append(directory)
        jail_dir = (directory, limit_file, procs_file)
        break
    if jail_dir is None:
        pytest.skip("no memory cgroup can be made here (needs cgroup v2 delegation or a writable v1 hierarchy)")
    directory, limit_file, procs_file = jail_dir

    def jail(pid: int, limit: int) -> None:
        (directory / limit_file).write_text(str(limit))
        (directory / procs_file).write_text(str(pid))

    yield jail
    for directory in made:
        for _ in range(50):  # the killed child leaves the cgroup when it is reaped
            try:
                directory.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_child_killed_by_the_oom_killer_is_out_of_memory_and_teaches_the_calibration(
        make_task, make_runner, memory_jail, local_data):
    # Moving a process into a cgroup moves none of its pages: only what it maps afterwards is charged there. So
    # every step must map far more than the jail holds, wherever in training the jail lands. The compact heap maps
    # each tensor afresh; one step of a 4,096-sample batch peaks at about 21 MiB (the tiny default task at 0.07
    # MiB let a child jailed a moment late train to the end within 8 MiB).
    runner = make_runner(local_data(n=JAIL_BATCH), budget=2**30, allocator="compact")  # (pooled reuses pages)
    assert runner.allocator == "compact"
    jailed: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while runner.child_pid is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if runner.child_pid is not None:
            # What the child allocates from now on is charged to a cgroup that holds 8 MiB: the kernel kills it.
            memory_jail(runner.child_pid, 8 * 2**20)
            jailed.append(runner.child_pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    update = runner.run(make_task(U(1.0), epochs=JAIL_EPOCHS, batch_size=JAIL_BATCH))
    watcher.join(10)
    assert jailed and jailed[0] != os.getpid()
    assert update.status == "failed"
    assert update.reason.startswith("training process was killed by the kernel's OOM killer"), update.reason
    assert runner.calibration.floor > 0
