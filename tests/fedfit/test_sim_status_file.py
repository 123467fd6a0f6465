"""fedfit.sim.status_file: a run's status file while it goes on (the login, owner-only, and the process running it),
once it ended (no login, its report), and a run whose process is gone without ending it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import yaml

from fedfit.sim.status_file import STATUS_FILE, RunMark, read_run_mark, utc, write_ended, write_running

BROKER = {"host": "127.0.0.1", "port": 8883, "username": "coordinator", "password_file": "/run/x/coordinator.password"}

#: When the runs of these tests started: before the end their reports say.
STARTED = 1795929600.0  # 2026-11-29T05:20:00Z


def test_a_run_going_on_then_ended_with_its_report(tmp_path: Path) -> None:
    mark = RunMark.this_process(tmp_path, STARTED)  # (before its report's end)
    path = write_running(tmp_path, "sim", BROKER, mark)
    assert path == tmp_path / STATUS_FILE and path.stat().st_mode & 0o777 == 0o600
    mapping = yaml.safe_load(path.read_text())
    assert mapping["federation"] == "sim" and mapping["broker"] == BROKER
    read = read_run_mark(path, mapping)
    assert read == mark and read.state() == "running" and read.over() is None

    (tmp_path / "report.json").write_text(json.dumps({"run": {"ended_at": "2026-11-29T05:31:07+00:00"}}))
    write_ended(tmp_path, "sim", mark, time.time())
    mapping = yaml.safe_load(path.read_text())
    assert "broker" not in mapping  # the login went with the broker
    ended = read_run_mark(path, mapping)
    assert ended is not None and ended.state() == "ended"
    assert ended.ended_at == "2026-11-29T05:31:07+00:00"  # the report's time
    assert ended.over() == (f"the run in {tmp_path.resolve()} ended at 2026-11-29 05:31:07 UTC; its fleet and broker "
                            f"are gone, its report is {(tmp_path / 'report.json').resolve()}")


def test_a_run_that_ended_without_a_report_says_where_its_log_is(tmp_path: Path) -> None:
    mark = RunMark.this_process(tmp_path, time.time())
    write_ended(tmp_path, "sim", mark, 1_800_000_000.0)
    ended = read_run_mark(tmp_path / STATUS_FILE, yaml.safe_load((tmp_path / STATUS_FILE).read_text()))
    assert ended is not None and ended.report is None and ended.ended_at == utc(1_800_000_000.0)
    assert "without a report (it was interrupted or failed: see" in (ended.over() or "")
    assert str(tmp_path.resolve() / "daemons.log") in (ended.over() or "")


def test_a_run_whose_process_is_gone_stopped_and_a_reused_pid_is_not_its_process(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    mark = RunMark(str(tmp_path), gone.pid, started, utc(started))
    assert mark.state() == "stopped"
    said = mark.over() or ""
    assert said.startswith(f"the run in {tmp_path} (started at ") and f"its process ({gone.pid}) is gone" in said
    assert "wrote no report" in said
    # This process's pid with another start time: a later process that was given the run's pid.
    own = RunMark.this_process(tmp_path, time.time())
    assert replace(own, process_started=own.process_started - 3600).state() == "stopped"


def test_a_status_file_from_before_the_run_section_is_known_by_the_report_beside_it(tmp_path: Path) -> None:
    path = tmp_path / STATUS_FILE
    mapping = {"federation": "sim", "broker": BROKER}
    path.write_text(yaml.safe_dump(mapping))
    assert read_run_mark(path, mapping) is None  # no report: the run may go on; its broker tells
    (tmp_path / "report.json").write_text(json.dumps({"run": {"ended_at": "2026-11-29T05:31:07+00:00"}}))
    mark = read_run_mark(path, mapping)
    assert mark is not None and mark.state() == "ended" and "ended at 2026-11-29 05:31:07 UTC" in (mark.over() or "")
    other = tmp_path / "coordinator.yaml"  # any other configuration file is one
    assert read_run_mark(other, mapping) is None


def test_a_run_directory_another_live_process_runs_is_refused_not_taken_over(tmp_path: Path) -> None:
    """A second run started in a directory a live run uses would remove that run's broker files: it is refused."""
    import pytest

    from fedfit.sim.harness import SimOptions, start_run_broker
    from fedfit.sim.status_file import running_elsewhere

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        mark = replace(RunMark.this_process(tmp_path, time.time()), pid=other.pid)
        mark = replace(mark, process_started=RunMark.this_process(tmp_path, 0).process_started)  # (not its start)
        write_running(tmp_path, "sim", BROKER, mark)
        assert running_elsewhere(tmp_path) is None  # the pid is alive, but that process started at another moment
        from fedfit.sim import status_file
        write_running(tmp_path, "sim", BROKER, replace(mark, process_started=status_file._process_started(other.pid)))
        assert running_elsewhere(tmp_path) is not None
        with pytest.raises(ValueError, match=f"is in use: process {other.pid} runs it"):
            start_run_broker(SimOptions(), tmp_path)
    finally:
        other.kill()
        other.wait()
    assert running_elsewhere(tmp_path) is None  # gone: the directory may be used again


def test_a_run_that_wrote_no_report_is_not_given_an_earlier_runs(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps({"run": {"ended_at": "2026-11-29T05:31:07+00:00"}}))
    mark = RunMark.this_process(tmp_path, time.time())  # resumed in that directory now, and failed
    write_ended(tmp_path, "sim", mark, time.time())
    ended = read_run_mark(tmp_path / STATUS_FILE, yaml.safe_load((tmp_path / STATUS_FILE).read_text()))
    assert ended is not None and ended.report is None and ended.ended_at != "2026-11-29T05:31:07+00:00"
