from __future__ import annotations

import pytest

from fedfit.sim.broker import external_broker, free_port, wait_for_port


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
