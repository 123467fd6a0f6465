"""fedfit.status_command: a simulated run's status file once the run is over (ended, or its process gone), and a
watch through a broker outage (a real mosquitto, stopped and started again): the screen says the broker is
unreachable and since when, then shows the fleet again."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from common.mqtt_link import MqttLink
from fedfit.cli import main
from fedfit.fleet_view import StatusBook
from fedfit.sim.broker import Broker, find_mosquitto, start_mosquitto
from fedfit.sim.status_file import RunMark, utc, write_ended, write_running
from fedfit.status_command import show
from protocol import Topics

#: A sim's login to a broker that went with it (its password file removed with it).
GONE_BROKER = {"host": "127.0.0.1", "port": 1, "username": "coordinator", "password_file": "/nonexistent/password"}


def status(config: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["status", "--config", str(config), *flags])
    captured = capsys.readouterr()
    assert "error" not in captured.err, captured.err
    return code, captured.out.strip()

#: When the runs of these tests started: before the end their reports say.
STARTED = 1795929600.0  # 2026-11-29T05:20:00Z


def test_the_status_of_a_run_that_ended_is_when_and_where_its_report_is(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    mark = RunMark.this_process(tmp_path, STARTED)  # (before its report's end)
    write_running(tmp_path, "sim", GONE_BROKER, mark)
    (tmp_path / "report.json").write_text(json.dumps({"run": {"ended_at": "2026-11-29T05:31:07+00:00"}}))
    path = write_ended(tmp_path, "sim", mark, time.time())
    code, said = status(path, capsys)
    assert code == 0 and said == (f"the run in {tmp_path.resolve()} ended at 2026-11-29 05:31:07 UTC; its fleet and "
                                  f"broker are gone, its report is {(tmp_path / 'report.json').resolve()}")
    code, said = status(path, capsys, "--json", "--watch")
    run = json.loads(said)["run"]
    assert code == 0 and run["state"] == "ended" and run["report"] == str((tmp_path / "report.json").resolve())


def test_the_status_of_a_killed_run_says_it_stopped_not_that_a_file_is_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    mark = RunMark(str(tmp_path), killed.pid, psutil.Process(killed.pid).create_time(), utc(time.time()))
    path = write_running(tmp_path, "sim", GONE_BROKER, mark)
    killed.kill()
    killed.wait()
    code, said = status(path, capsys)
    assert code == 1 and said.startswith(f"the run in {tmp_path} (started at ") and "stopped before it ended" in said
    assert "password_file" not in said


def watch_args(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"json": False, "watch": True, "interval": 0.1, "wait": 0.0, **given})


class Screens(io.StringIO):
    """What ``show`` prints, one screen after another, and a way to wait for one."""

    def __init__(self) -> None:
        super().__init__()
        self._printed = threading.Condition()

    def write(self, text: str) -> int:
        with self._printed:
            written = super().write(text)
            self._printed.notify_all()
        return written

    def screens(self) -> list[str]:
        with self._printed:
            return [screen for screen in self.getvalue().split("\n\n") if screen.strip()]

    def wait_for(self, check: Callable[[str], bool], after: int = 0, timeout: float = 60.0) -> int:
        """The index of the first screen from ``after`` on of which ``check`` holds (AssertionError on timeout)."""
        def found() -> int | None:
            return next((index for index, screen in enumerate(self.screens()) if index >= after and check(screen)),
                        None)

        with self._printed:
            assert self._printed.wait_for(lambda: found() is not None, timeout), self.screens()[-3:]
        index = found()
        assert index is not None
        return index


def test_a_screen_says_since_when_the_broker_is_unreachable_and_json_says_it_too() -> None:
    now = time.time()
    link = SimpleNamespace(broker="broker.lan:8883", down_for=lambda: 180.0)
    def since(out: str) -> bool:  # the clock of the moment the test read, or the next second (read a bit later)
        return any(out.startswith(f"broker broker.lan:8883 unreachable since "
                                  f"{time.strftime('%H:%M:%S', time.localtime(now - 180 + late))} (3 min ago), "
                                  "reconnecting: the fleet below is as last seen\nfederation 'lab'") for late in (0, 1))

    for flags, check in ((watch_args(watch=False), since),
                         (watch_args(watch=False, json=True), lambda out: json.loads(out)["broker"]["connected"]
                          is False and abs(json.loads(out)["broker"]["lost_at"] - (now - 180)) < 60)):
        out = io.StringIO()
        assert show(link, StatusBook("lab"), flags, out, threading.Event()) == 0  # type: ignore[arg-type]
        assert check(out.getvalue()), out.getvalue()


@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_watch_through_a_broker_outage_says_so_and_recovers() -> None:
    broker: Broker = start_mosquitto()
    topics, book = Topics("lab"), StatusBook("lab")
    link = MqttLink(client_id=f"fedfit-status-lab-{uuid.uuid4().hex[:8]}", broker=broker.client_config("status"),
                    subscriptions=[topics.all_agent_status(), topics.coordinator_status()], handler=book.feed)
    out, stop, back = Screens(), threading.Event(), threading.Event()
    watcher = threading.Thread(target=show, args=(link, book, watch_args(), out, stop), daemon=True)
    restart = threading.Thread(target=broker.restart, args=(120.0, back), daemon=True)
    unreachable = f"broker 127.0.0.1:{broker.port} unreachable since "
    try:
        link.start(timeout=10)
        watcher.start()
        first = out.wait_for(lambda screen: screen.startswith("federation 'lab'"))
        restart.start()  # the broker goes, and stays away until told
        lost = out.wait_for(lambda screen: screen.startswith(unreachable), after=first)
        assert "reconnecting: the fleet below is as last seen\nfederation 'lab'" in out.screens()[lost]
        back.set()
        restart.join(60)
        out.wait_for(lambda screen: screen.startswith("federation 'lab'"), after=lost)  # reconnected
    finally:
        back.set()
        stop.set()
        watcher.join(30)
        link.stop()
        broker.stop()
    assert not watcher.is_alive()
