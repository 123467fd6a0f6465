"""How a simulated run ends, and what it leaves: a run that ends removes its broker's files (the secrets) and
marks its status file ended, which ``fedfit status`` then reports; a ``fedfit sim`` killed with SIGKILL in the
middle of training takes its mosquitto, its training forkserver and children with it, leaves no secret outside its
run's directory, and ``fedfit status`` says it stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from edge_agent.workdir import PROGRESS_FILE
from fedfit.cli import main
from fedfit.sim.harness import BROKER_DIR, SimOptions, run_simulation
from fedfit.sim.status_file import STATUS_FILE

from .conftest import tiny_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: Names of the secured broker's secrets (fedfit.secure_broker.directory).
SECRETS = {"ca.key", "server.key", "passwd"}


def secrets_under(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.name in SECRETS or path.suffix == ".password"]


def test_a_run_that_ends_removes_its_secrets_and_says_it_ended(mosquitto_installed: None, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    options = SimOptions(algorithm="fedavg", agents=2, rounds=1, dataset="digits", federation="ends",
                         base=tiny_config(), state_dir=str(run))
    outcome = run_simulation(options, progress=None)
    assert outcome.report["broker"]["secured"]
    assert not (run / BROKER_DIR).exists() and secrets_under(run) == []
    status = yaml.safe_load((run / STATUS_FILE).read_text())
    assert "broker" not in status and status["run"]["ended_at"] == outcome.report["run"]["ended_at"]
    capsys.readouterr()
    assert main(["status", "--config", str(run / STATUS_FILE)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"the run in {run.resolve()} ended at ") and str(run.resolve() / "report.json") in said


def training_began(run: Path) -> bool:
    """Whether a training child of the run has begun its epochs (its progress file is in its task's directory)."""
    try:
        return bool(list((run / "agents").rglob(PROGRESS_FILE)))
    except FileNotFoundError:  # a task's directory went while it was read
        return False


def test_a_killed_sim_takes_its_broker_and_training_processes_with_it(
        mosquitto_installed: None, tmp_path: Path, wait_ended: Callable[[int, float], bool],
        capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    # TMPDIR short: the forkserver's socket goes in a new directory under it, within AF_UNIX's 107 bytes
    temporary, run = Path(tempfile.mkdtemp(prefix="fedfit-killed-")), tmp_path / "run"
    request.addfinalizer(lambda: shutil.rmtree(temporary, ignore_errors=True))
    sim = subprocess.Popen(
        [sys.executable, "-m", "fedfit.cli", "sim", "--algorithm", "fedavg", "--agents", "2", "--rounds", "2",
         "--dataset", "digits", "--federation", "killed", "--run-dir", str(run),
         "--set", "recipe.epochs=1000", "--set", "round_timeout_s=3600"],  # training that outlasts the test
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(temporary)})
    try:
        assert sim.stderr is not None
        for line in sim.stderr:  # the run's progress: its first round has sent its tasks
            if line.startswith("round 1/2"):
                break
        else:
            pytest.fail(f"the sim ended before its first round (exit status {sim.wait()})")
        deadline = time.monotonic() + 300
        while not training_began(run):
            assert time.monotonic() < deadline, "no training child started"
            if sim.poll() is not None:  # (its training failed: the run went on to its end)
                pytest.fail(f"the sim ended before a training child began (exit status {sim.returncode}): "
                            f"{sim.stderr.read()[-3000:]}")
            time.sleep(0.1)
        processes = psutil.Process(sim.pid).children(recursive=True)
        # the agents' training children: forked by the training forkserver, a child of the sim
        assert [p for p in processes if p.ppid() != sim.pid and "forkserver" in " ".join(p.cmdline())], processes
        [mosquitto] = [p for p in processes if p.name() == "mosquitto"]
        assert Path(mosquitto.cmdline()[-1]).is_relative_to(run / BROKER_DIR)  # its configuration, with the secrets
        assert (run / BROKER_DIR).stat().st_mode & 0o777 == 0o700
        sim.send_signal(signal.SIGKILL)
        sim.wait()
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    left = [process.pid for process in processes if not wait_ended(process.pid, 60)]
    assert left == [], [" ".join(psutil.Process(pid).cmdline())[:120] for pid in left]
    assert secrets_under(temporary) == [] and secrets_under(run / BROKER_DIR)  # the secrets: only in the run
    capsys.readouterr()
    assert main(["status", "--config", str(run / STATUS_FILE)]) == 1
    said = capsys.readouterr().out
    assert said.startswith(f"the run in {run.resolve()} (started at ") and "stopped before it ended" in said
