"""A simulated run's status file, ``RUN/status.yaml``: what ``fedfit status --config RUN/status.yaml`` reads.

While the run goes on it holds the federation, the coordinator's login to the run's broker (so the file is
readable by its owner only) and a ``run`` section: the run's directory and the process running it (its pid and
start time, which tell it from a later process given the same pid). When the run ends it is written again
without the login (the broker and its secrets are gone) and with the time it ended and its report. A run that
never got there (killed, or a hard crash) keeps the process's mark: once that process is gone, ``fedfit status``
says the run stopped without a report instead of failing to reach a broker that went with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import yaml

from common.config import from_mapping
from common.durable import write_atomic

__all__ = ["STATUS_FILE", "RunMark", "read_run_mark", "write_ended", "write_running"]

#: The status file's name in a run's directory.
STATUS_FILE = "status.yaml"
#: The report's name in a run's directory (``fedfit.sim.rundir.REPORT_FILE``; not imported: that module pulls the
#: plots in, and ``fedfit status`` stays light).
_REPORT_FILE = "report.json"


def utc(moment: float) -> str:
    """``moment`` (seconds since the epoch) as the report writes times: ISO 8601 in UTC, to the second."""
    return datetime.fromtimestamp(moment, timezone.utc).isoformat(timespec="seconds")


def _shown(when: str) -> str:
    """An ISO time as a reader takes it in: ``2026-11-29 05:31:07 UTC``."""
    try:
        moment = datetime.fromisoformat(when)
    except ValueError:
        return when
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started, None when there is none: on Linux its start in clock ticks since boot (from
    ``/proc``: the same however the wall clock is stepped meanwhile, as NTP does to a Pi without a clock of its
    own), elsewhere seconds since the epoch."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return float(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # a Linux without that process
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


@dataclass(frozen=True)
class RunMark:
    """The ``run`` section of a status file: the run's ``directory``, the process that runs it (``pid``, started at
    ``process_started``: ticks since boot on Linux, else seconds since the epoch), when the run started and, once it has, when it ended
    (``ended_at``) and its report (``report``, a path; None when the run wrote none)."""

    directory: str
    pid: int = 0
    process_started: float = 0.0
    started_at: str = ""
    ended_at: str | None = None
    report: str | None = None

    @classmethod
    def this_process(cls, directory: Path, started: float) -> RunMark:
        """The mark of a run that this process runs in ``directory`` since ``started``."""
        pid = os.getpid()
        return cls(str(directory.resolve()), pid, _process_started(pid) or 0.0, utc(started))

    def running(self) -> bool:
        """Whether the run's process is still there (the same pid, started at the same time), and the run has not
        ended."""
        if self.ended_at is not None or not self.pid:
            return False
        started = _process_started(self.pid)
        return started is not None and abs(started - self.process_started) < 1.0  # (a pid used again: another)

    def state(self) -> str:
        """``running``, ``ended`` (it ended, with or without a report) or ``stopped`` (its process went without
        ending it: killed, or crashed)."""
        if self.ended_at is not None:
            return "ended"
        return "running" if self.running() else "stopped"

    def over(self) -> str | None:
        """One sentence when the run is over (what ``fedfit status`` says instead of the fleet), None while it
        runs."""
        state = self.state()
        if state == "running":
            return None
        if state == "ended":
            said = f"the run in {self.directory} ended at {_shown(self.ended_at or '')}"
            if self.report is not None:
                return f"{said}; its fleet and broker are gone, its report is {self.report}"
            return (f"{said} without a report (it was interrupted or failed: see {Path(self.directory) / 'daemons.log'}"
                    f"); its fleet and broker are gone")
        since = f" (started at {_shown(self.started_at)})" if self.started_at else ""
        return (f"the run in {self.directory}{since} stopped before it ended: its process ({self.pid}) is gone, "
                f"killed or crashed, and wrote no report; its fleet and broker went with it (its logs: "
                f"{Path(self.directory) / 'daemons.log'})")

    def as_json(self) -> dict[str, Any]:
        """The mark and its state, as ``fedfit status --json`` prints it."""
        return {**asdict(self), "state": self.state()}


def write_running(run_dir: Path, federation: str, broker: dict[str, Any], mark: RunMark) -> Path:
    """Write the status file of a run going on (the coordinator's ``broker`` section included: owner-only)."""
    return _write(run_dir, {"federation": federation, "broker": broker, "run": asdict(mark)})


def write_ended(run_dir: Path, federation: str, mark: RunMark, ended: float) -> Path:
    """Write the status file of a run that ended: no login any more; its report when it wrote one, and the time it
    ended (the report's, else ``ended``)."""
    report = run_dir / _REPORT_FILE
    ended_at = _report_ended_at(report) if report.is_file() else None
    if ended_at is not None and mark.started_at and _before(ended_at, mark.started_at):
        ended_at = None  # an earlier run's report (this one, resumed in its directory, wrote none)
    ended_mark = replace(mark, ended_at=ended_at or utc(ended), report=str(report.resolve()) if ended_at else None)
    return _write(run_dir, {"federation": federation, "run": asdict(ended_mark)})


def _before(first: str, second: str) -> bool:
    """Whether ISO time ``first`` is before ``second`` (False when either cannot be read)."""
    try:
        return datetime.fromisoformat(first) < datetime.fromisoformat(second)
    except (TypeError, ValueError):
        return False


def _report_ended_at(report: Path) -> str | None:
    """The time a report says its run ended (``run.ended_at``), None when it cannot be read."""
    try:
        ended = json.loads(report.read_text()).get("run", {}).get("ended_at")
    except (OSError, ValueError, AttributeError):
        return None
    return ended if isinstance(ended, str) else None


def _write(run_dir: Path, mapping: dict[str, Any]) -> Path:
    path = run_dir / STATUS_FILE
    write_atomic(path, yaml.safe_dump(mapping, sort_keys=False).encode(), mode=0o600)
    return path


def read_run_mark(path: Path, mapping: dict[str, Any]) -> RunMark | None:
    """The run a status file (``path``, read as ``mapping``) belongs to: its ``run`` section; for a status file that
    predates the section, a run directory holding a report (the run ended then); None for any other configuration
    file. ConfigError for a malformed section."""
    if "run" in mapping:
        return from_mapping(RunMark, mapping["run"], "run")
    report = path.parent / _REPORT_FILE
    if path.name != STATUS_FILE or not report.is_file():
        return None
    return RunMark(str(path.parent.resolve()), ended_at=_report_ended_at(report) or "an unknown time",
                   report=str(report.resolve()))



def running_elsewhere(run_dir: Path) -> RunMark | None:
    """The run another process runs in ``run_dir`` now, as its status file says (None when none does: no file, one
    that cannot be read, a run that ended or whose process is gone)."""
    path = run_dir / STATUS_FILE
    try:
        mapping = yaml.safe_load(path.read_text())
        mark = read_run_mark(path, mapping) if isinstance(mapping, dict) else None
    except (OSError, yaml.YAMLError, ValueError):
        return None
    return mark if mark is not None and mark.running() and mark.pid != os.getpid() else None
