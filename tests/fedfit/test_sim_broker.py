from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from fedfit.sim import broker as broker_module
from fedfit.sim.broker import (
    BrokerStartError,
    external_broker,
    find_mosquitto,
    free_port,
    start_mosquitto,
    wait_for_port,
)

ROOT = Path(__file__).resolve().parents[2]


def test_external_broker_parses_host_and_port() -> None:
    broker = external_broker("10.0.0.5:1884")
    assert (broker.kind, broker.host, broker.port) == ("external", "10.0.0.5", 1884)
    broker.stop()  # a no-op for a broker we did not start


@pytest.mark.parametrize("text", ["nowhere", "host:", ":1883", "host:70000", "host:abc"])
def test_external_broker_rejects_malformed_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        external_broker(text)


def test_free_port_is_free() -> None:
    assert not wait_for_port("127.0.0.1", free_port(), 0.2)


@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_broker_that_cannot_be_secured_is_one_sentence_and_leaves_no_files(monkeypatch, tmp_path) -> None:
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(prefix: str) -> str:
        made.append(Path(real_mkdtemp(prefix=prefix, dir=tmp_path)))
        return str(made[-1])

    monkeypatch.setattr(broker_module.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setenv("PATH", str(tmp_path))  # no openssl on it
    with pytest.raises(BrokerStartError, match=r"^cannot secure the broker: the 'openssl' command is not installed "
                                               r".*\(--insecure-broker runs one without TLS and logins\)$"):
        start_mosquitto(find_mosquitto(), federation="lab")
    assert made and not made[0].exists()


@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_secured_broker_keeps_its_files_in_the_directory_given_and_stop_removes_them(tmp_path) -> None:
    workdir = tmp_path / "run" / "broker"
    broker = start_mosquitto(federation="lab", workdir=workdir)
    try:
        assert broker.directory is not None and broker.directory.path.is_relative_to(workdir)
        assert workdir.stat().st_mode & 0o777 == 0o700
        password = Path(broker.coordinator_config().password_file or "")
        assert password.is_relative_to(workdir) and password.stat().st_mode & 0o077 == 0
        assert (broker.directory.path / "ca.key").stat().st_mode & 0o077 == 0
    finally:
        broker.stop()
    assert not workdir.exists() and (tmp_path / "run").is_dir()
    with pytest.raises(BrokerStartError, match="cannot make the broker's directory"):
        start_mosquitto(federation="lab", workdir=tmp_path)  # one that exists: never another's files


@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_broker_ends_with_the_process_that_started_it_killed_and_leaves_no_secret_outside_its_run(
        tmp_path, wait_ended) -> None:
    """As a SIGKILLed ``fedfit sim`` does: a process starts a secured broker in its run's directory, from a thread
    that then ends, and is killed. Its mosquitto ends too, and nothing was written to the temporary directory."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = tmp_path / "run"
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, threading
        from pathlib import Path
        from fedfit.sim.broker import start_mosquitto
        started = []
        thread = threading.Thread(target=lambda: started.append(
            start_mosquitto(federation="lab", workdir=Path({str(run / "broker")!r}))))
        thread.start()
        thread.join()
        broker = started[0]
        broker.add_logins(["sim-000"])
        print(json.dumps([broker.pid, broker.coordinator_config().password_file]),
              flush=True)
        threading.Event().wait()
    """)], cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "TMPDIR": str(temporary)})
    assert starter.stdout is not None
    line = starter.stdout.readline()
    assert line, "the broker did not start"
    mosquitto, password = json.loads(line)
    assert not wait_ended(mosquitto, 0) and Path(password).is_relative_to(run / "broker")
    starter.kill()
    starter.wait()
    assert wait_ended(mosquitto, 30)
    assert list(temporary.iterdir()) == []
    # What is left is in the run's directory, readable by its owner only (fedfit sim removes it at its next start).
    assert (run / "broker").stat().st_mode & 0o777 == 0o700
