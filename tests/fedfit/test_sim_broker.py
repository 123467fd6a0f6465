from __future__ import annotations

import tempfile
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
